// Types of waterfall-layout.js (a browser module the console serves as is; tests import it through these).

export interface WaterfallPhase {
  phase: string;
  start_ms: number;
  duration_ms: number;
  worker?: string;
  incomplete?: boolean;
  attributes?: Record<string, string | number | boolean>;
}

export interface WaterfallView {
  total_ms: number;
  phases: WaterfallPhase[];
  timings?: { ttft_ms: number | null };
  usage?: { completion_tokens: number };
  decode?: { step_p50_ms: number | null; step_max_ms: number | null } | null;
  tbt?: { p50_ms: number | null; p99_ms: number | null };
  routing?: {
    worker: string; strategy: string; prefill_worker: string | null; candidates: number | null; overlap_tokens: number | null;
    reason: string | null;
  } | null;
  token_times_ms?: number[];
  token_times_stride?: number;
  migrations?: { from_worker: string; to_worker: string | null; after_tokens: number; reason: string }[];
}

export interface WaterfallGeometry {
  width: number;
  /** Pixels left of the time axis, for the row labels. */
  labelWidth: number;
  rowHeight: number;
  /** Pixels above the first row (the axis labels). Default 24. */
  top?: number;
  rightPad?: number;
}

export interface WaterfallBar {
  phase: string;
  group: string;
  startMs: number;
  endMs: number;
  x: number;
  w: number;
  incomplete: boolean;
  worker?: string;
  detail: string[];
}

export interface WaterfallRow {
  key: string;
  phase: string;
  group: string;
  label: string;
  y: number;
  bars: WaterfallBar[];
}

export interface WaterfallLayout {
  totalMs: number;
  width: number;
  height: number;
  plotX0: number;
  plotX1: number;
  rowHeight: number;
  ticks: { ms: number; x: number; label: string }[];
  rows: WaterfallRow[];
  tokens: { ms: number; x: number; y: number }[];
  marks: { kind: 'first_token' | 'migration'; ms: number | null; x: number | null; label: string }[];
}

export function phaseGroup(phase: string): string;
export function formatMs(ms: number | null | undefined): string;
export function formatBytes(n: number): string;
export function timeTicks(totalMs: number, count?: number): number[];
export function layoutWaterfall(view: WaterfallView, geometry: WaterfallGeometry): WaterfallLayout;
