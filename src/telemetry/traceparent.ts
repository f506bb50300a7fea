// W3C Trace Context (https://www.w3.org/TR/trace-context/): the traceparent header, so a client's trace continues
// through Conduit and Conduit's trace id can be handed back. Plain string work, no OpenTelemetry dependency.

import { randomFillSync } from 'node:crypto';

export interface TraceParent {
  /** Two lowercase hex digits; 00 is the only version defined today. */
  version: string;
  /** 32 lowercase hex digits, not all zero. */
  traceId: string;
  /** The caller's span: 16 lowercase hex digits, not all zero. */
  parentSpanId: string;
  /** Trace flags byte; bit 0 = the caller sampled this trace. */
  flags: number;
  sampled: boolean;
}

const HEX_TRACE_ID = /^[0-9a-f]{32}$/;
const HEX_SPAN_ID = /^[0-9a-f]{16}$/;
const HEX_BYTE = /^[0-9a-f]{2}$/;
const ZERO_TRACE_ID = '0'.repeat(32);
const ZERO_SPAN_ID = '0'.repeat(16);

export function isValidTraceId(id: string): boolean {
  return HEX_TRACE_ID.test(id) && id !== ZERO_TRACE_ID;
}

export function isValidSpanId(id: string): boolean {
  return HEX_SPAN_ID.test(id) && id !== ZERO_SPAN_ID;
}

/**
 * Parses a traceparent header value; undefined when it is malformed, in which case the spec says to start a new
 * trace rather than fail the request. Versions above 00 are parsed by the 00 layout and their extra fields ignored,
 * as the spec asks of a 00 implementation.
 */
export function parseTraceparent(header: string | undefined | null): TraceParent | undefined {
  if (!header) return undefined;
  const value = header.trim();
  if (value.length < 55) return undefined;
  const version = value.slice(0, 2);
  if (!HEX_BYTE.test(version) || version === 'ff') return undefined;
  if (version === '00' && value.length !== 55) return undefined;
  if (value.length > 55 && value[55] !== '-') return undefined;
  if (value[2] !== '-' || value[35] !== '-' || value[52] !== '-') return undefined;
  const traceId = value.slice(3, 35);
  const parentSpanId = value.slice(36, 52);
  const flagsHex = value.slice(53, 55);
  if (!isValidTraceId(traceId) || !isValidSpanId(parentSpanId) || !HEX_BYTE.test(flagsHex)) return undefined;
  const flags = Number.parseInt(flagsHex, 16);
  return { version, traceId, parentSpanId, flags, sampled: (flags & 1) === 1 };
}

/** A version-00 traceparent value. */
export function formatTraceparent(traceId: string, spanId: string, sampled: boolean): string {
  if (!isValidTraceId(traceId)) throw new RangeError(`not a trace id: ${traceId}`);
  if (!isValidSpanId(spanId)) throw new RangeError(`not a span id: ${spanId}`);
  return `00-${traceId}-${spanId}-${sampled ? '01' : '00'}`;
}

// Ids come from a pool of random bytes refilled 4 KiB at a time: one getrandom call serves ~170 requests instead of
// one call per id.
const pool = Buffer.alloc(4096);
let poolOffset = pool.length;

function randomHex(bytes: number): string {
  for (;;) {
    if (poolOffset + bytes > pool.length) {
      randomFillSync(pool);
      poolOffset = 0;
    }
    const hex = pool.toString('hex', poolOffset, poolOffset + bytes);
    poolOffset += bytes;
    // All-zero ids are invalid; the chance is 2^-64 or less, but the spec forbids them outright.
    if (!/^0+$/.test(hex)) return hex;
  }
}

export function randomTraceId(): string {
  return randomHex(16);
}

export function randomSpanId(): string {
  return randomHex(8);
}
