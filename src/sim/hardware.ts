// Hardware profiles for the performance model: what one GPU can compute and stream, and what the links between GPUs
// and hosts can carry. Figures are vendor datasheet numbers, dense (without 2:4 sparsity); docs/simulator.md names the
// source of each. Everything the model derives from them is bytes / (bytes per second) or FLOPs / (FLOP/s), so the
// units are spelled out in every field name.

/** A point-to-point or switched interconnect, as one GPU (or one NIC) sees it. */
export interface LinkProfile {
  id: string;
  name: string;
  /**
   * Bytes per second one endpoint can send while it also receives the same amount (one direction). Collectives and
   * transfers are limited by this, not by the bidirectional sum vendors usually quote.
   */
  bytesPerSecPerDirection: number;
  /** The vendor's headline figure (both directions added), kept to show where the per-direction number comes from. */
  bidirectionalBytesPerSec: number;
  /**
   * Fixed cost of one hop of a collective or one transfer (launch, handshake, switch traversal), in microseconds.
   * An estimate, not a datasheet figure: it is what makes a decode step's 2 x layers small all-reduces cost
   * something even though their bytes are negligible.
   */
  hopLatencyUs: number;
}

export interface HardwareProfile {
  id: string;
  name: string;
  /** Dense BF16 tensor-core peak, FLOP/s, without sparsity. */
  bf16FlopsPerSec: number;
  /** Dense FP8 tensor-core peak, FLOP/s, without sparsity; absent when the GPU has no FP8 tensor cores (A100). */
  fp8FlopsPerSec?: number;
  /** HBM capacity in bytes. Datasheet "GB" for HBM are binary gigabytes (an 80 GB A100 reports 81,920 MiB). */
  hbmBytes: number;
  /** HBM bandwidth in bytes per second (decimal, as the datasheet states it). */
  hbmBytesPerSec: number;
  /** The GPU-to-GPU link inside a node, used for tensor-parallel collectives. */
  tpLink: LinkProfile;
  /** GPUs that share that link inside one node (the largest tensor-parallel group without leaving the node). */
  gpusPerNode: number;
}

const GIB = 2 ** 30;
const GB_PER_SEC = 1e9;
const TFLOPS = 1e12;

// ---------------------------------------------------------------------------------------------------------------
// Links

/** NVLink 3 (A100 SXM): 600 GB/s total per GPU, 300 GB/s each way. */
export const NVLINK3: LinkProfile = {
  id: 'nvlink3', name: 'NVLink 3 (A100)',
  bytesPerSecPerDirection: 300 * GB_PER_SEC, bidirectionalBytesPerSec: 600 * GB_PER_SEC, hopLatencyUs: 1,
};

/** NVLink 4 (H100/H200 SXM): 18 links, 900 GB/s total per GPU, 450 GB/s each way. */
export const NVLINK4: LinkProfile = {
  id: 'nvlink4', name: 'NVLink 4 (H100/H200)',
  bytesPerSecPerDirection: 450 * GB_PER_SEC, bidirectionalBytesPerSec: 900 * GB_PER_SEC, hopLatencyUs: 1,
};

/** NVLink 5 (B200): 1.8 TB/s total per GPU, 900 GB/s each way. */
export const NVLINK5: LinkProfile = {
  id: 'nvlink5', name: 'NVLink 5 (B200)',
  bytesPerSecPerDirection: 900 * GB_PER_SEC, bidirectionalBytesPerSec: 1800 * GB_PER_SEC, hopLatencyUs: 1,
};

/** InfiniBand NDR, one 400 Gb/s port: 50 GB/s each way. */
export const INFINIBAND_NDR: LinkProfile = {
  id: 'ib-ndr', name: 'InfiniBand NDR 400 Gb/s',
  bytesPerSecPerDirection: 400e9 / 8, bidirectionalBytesPerSec: 2 * 400e9 / 8, hopLatencyUs: 3,
};

/**
 * PCIe 5.0 x16: 32 GT/s per lane x 16 lanes with 128b/130b encoding = 63.0 GB/s each way (the "128 GB/s" on
 * datasheets is both directions, before encoding).
 */
export const PCIE5_X16: LinkProfile = {
  id: 'pcie5', name: 'PCIe 5.0 x16',
  bytesPerSecPerDirection: (32e9 * 16 * 128) / 130 / 8, bidirectionalBytesPerSec: 128 * GB_PER_SEC, hopLatencyUs: 2,
};

/**
 * Where a simulated worker's lower KV tiers sit (src/engine/kv-cache/tiers.ts): host DRAM reached over each GPU's
 * PCIe link (each GPU moves its own shard of a block, so tp links work side by side), and a local NVMe drive shared
 * by the worker. Bandwidths are sustained figures each way, latency is per transfer (a block run).
 */
export interface KvTierProfile {
  id: string;
  name: string;
  bytesPerSec: number;
  latencyUs: number;
  /** Each GPU has its own path (PCIe): a worker of tp GPUs moves tp shards at once. False: one path per worker. */
  perGpu: boolean;
}

/** Host DRAM over PCIe 5.0 x16 (pinned memory, DMA): about 80% of the link's 63 GB/s each way. */
export const HOST_RAM_PCIE5: KvTierProfile = {
  id: 'pcie5-host', name: 'host DRAM over PCIe 5.0 x16', bytesPerSec: 0.8 * PCIE5_X16.bytesPerSecPerDirection, latencyUs: 10, perGpu: true,
};

/** Host DRAM over PCIe 4.0 x16 (A100 nodes): about 25 GB/s sustained each way. */
export const HOST_RAM_PCIE4: KvTierProfile = {
  id: 'pcie4-host', name: 'host DRAM over PCIe 4.0 x16', bytesPerSec: 25 * GB_PER_SEC, latencyUs: 10, perGpu: true,
};

/** One NVMe Gen4 x4 SSD (sequential read ~7 GB/s; ~5 GB/s sustained for block-sized reads), ~80 µs per read. */
export const NVME_GEN4: KvTierProfile = {
  id: 'nvme-gen4', name: 'NVMe Gen4 x4 SSD', bytesPerSec: 5 * GB_PER_SEC, latencyUs: 80, perGpu: false,
};

export const KV_TIER_PROFILES: Readonly<Record<string, KvTierProfile>> = {
  'pcie5-host': HOST_RAM_PCIE5, 'pcie4-host': HOST_RAM_PCIE4, 'nvme-gen4': NVME_GEN4,
};

/** The host tier a GPU reaches: PCIe 4.0 on an A100, PCIe 5.0 on later GPUs. */
export function hostTierFor(hw: HardwareProfile): KvTierProfile {
  return hw.id.startsWith('a100') ? HOST_RAM_PCIE4 : HOST_RAM_PCIE5;
}

export const LINK_PROFILES: Readonly<Record<string, LinkProfile>> = {
  nvlink3: NVLINK3, nvlink4: NVLINK4, nvlink5: NVLINK5, 'ib-ndr': INFINIBAND_NDR, pcie5: PCIE5_X16,
};

// ---------------------------------------------------------------------------------------------------------------
// GPUs

export const H100_SXM: HardwareProfile = {
  id: 'h100', name: 'H100 SXM5 80GB',
  bf16FlopsPerSec: 989.4 * TFLOPS, fp8FlopsPerSec: 1978.9 * TFLOPS,
  hbmBytes: 80 * GIB, hbmBytesPerSec: 3.35e12,
  tpLink: NVLINK4, gpusPerNode: 8,
};

/** The H100's GH100 die with HBM3e: same compute, more and faster memory. */
export const H200_SXM: HardwareProfile = {
  ...H100_SXM,
  id: 'h200', name: 'H200 SXM 141GB',
  hbmBytes: 141 * GIB, hbmBytesPerSec: 4.8e12,
};

export const A100_SXM_80GB: HardwareProfile = {
  id: 'a100', name: 'A100 SXM4 80GB',
  bf16FlopsPerSec: 312 * TFLOPS,
  hbmBytes: 80 * GIB, hbmBytesPerSec: 2.039e12,
  tpLink: NVLINK3, gpusPerNode: 8,
};

/** B200 as shipped in HGX/DGX B200 (1,000 W configuration). */
export const B200: HardwareProfile = {
  id: 'b200', name: 'B200 (HGX) 180GB',
  bf16FlopsPerSec: 2250 * TFLOPS, fp8FlopsPerSec: 4500 * TFLOPS,
  hbmBytes: 180 * GIB, hbmBytesPerSec: 8e12,
  tpLink: NVLINK5, gpusPerNode: 8,
};

export const HARDWARE_PROFILES: Readonly<Record<string, HardwareProfile>> = {
  h100: H100_SXM, h200: H200_SXM, a100: A100_SXM_80GB, b200: B200,
};

const HARDWARE_ALIASES: Readonly<Record<string, string>> = {
  'h100-sxm': 'h100', 'h100-sxm5': 'h100', 'h200-sxm': 'h200', 'a100-80gb': 'a100', 'a100-sxm': 'a100',
};

/** Looks a GPU up by id ("h100") or alias ("h100-sxm"), case-insensitively; throws a RangeError listing the ids. */
export function getHardwareProfile(id: string): HardwareProfile {
  const key = id.toLowerCase();
  // Own keys only: "constructor" or "__proto__" name no profile.
  const resolved = Object.hasOwn(HARDWARE_ALIASES, key) ? HARDWARE_ALIASES[key]! : key;
  const profile = Object.hasOwn(HARDWARE_PROFILES, resolved) ? HARDWARE_PROFILES[resolved] : undefined;
  if (!profile) {
    throw new RangeError(`unknown GPU "${id}"; known: ${Object.keys(HARDWARE_PROFILES).join(', ')}`);
  }
  return profile;
}

/** Looks a link up by id ("nvlink4", "ib-ndr", "pcie5"); throws a RangeError listing the ids. */
export function getLinkProfile(id: string): LinkProfile {
  const key = id.toLowerCase();
  const profile = Object.hasOwn(LINK_PROFILES, key) ? LINK_PROFILES[key] : undefined;
  if (!profile) throw new RangeError(`unknown link "${id}"; known: ${Object.keys(LINK_PROFILES).join(', ')}`);
  return profile;
}

/** Peak FLOP/s the weight matmuls run at: FP8 tensor cores for 1-byte weights where the GPU has them, else BF16. */
export function matmulPeakFlopsPerSec(hw: HardwareProfile, weightBytesPerParam: number): number {
  return weightBytesPerParam === 1 && hw.fp8FlopsPerSec !== undefined ? hw.fp8FlopsPerSec : hw.bf16FlopsPerSec;
}
