import { test } from 'node:test';
import assert from 'node:assert/strict';
import {
  A100_SXM_80GB, B200, H100_SXM, H200_SXM, HARDWARE_PROFILES, LINK_PROFILES, getHardwareProfile, getLinkProfile,
  matmulPeakFlopsPerSec,
} from '../../src/sim/hardware.ts';

test('per-direction link bandwidth is half the bidirectional headline, or derived from the line rate', () => {
  for (const id of ['nvlink3', 'nvlink4', 'nvlink5', 'ib-ndr']) {
    const link = getLinkProfile(id);
    assert.equal(link.bytesPerSecPerDirection * 2, link.bidirectionalBytesPerSec, id);
  }
  assert.equal(getLinkProfile('ib-ndr').bytesPerSecPerDirection, 400e9 / 8);
  // PCIe 5 x16: 32 GT/s x 16 lanes, 128 payload bits in 130, about 63 GB/s each way (under half the "128 GB/s").
  const pcie = getLinkProfile('pcie5').bytesPerSecPerDirection;
  assert.ok(Math.abs(pcie - (32e9 * 16 * (128 / 130)) / 8) < 1);
  assert.ok(pcie < LINK_PROFILES.pcie5!.bidirectionalBytesPerSec / 2);
});

test('GPU profiles: the H200 is an H100 with more, faster HBM; dense figures are half the sparse ones', () => {
  assert.equal(H200_SXM.bf16FlopsPerSec, H100_SXM.bf16FlopsPerSec);
  assert.ok(H200_SXM.hbmBytesPerSec > H100_SXM.hbmBytesPerSec && H200_SXM.hbmBytes > H100_SXM.hbmBytes);
  // Datasheets quote 1,979 (H100) and 4,500 (B200) BF16 TFLOPS with sparsity.
  assert.ok(Math.abs(H100_SXM.bf16FlopsPerSec * 2 - 1979e12) < 1e12);
  assert.equal(B200.bf16FlopsPerSec * 2, 4500e12);
  for (const hw of Object.values(HARDWARE_PROFILES)) {
    if (hw.fp8FlopsPerSec !== undefined) assert.ok(Math.abs(hw.fp8FlopsPerSec / hw.bf16FlopsPerSec - 2) < 1e-3);
  }
  assert.equal(matmulPeakFlopsPerSec(A100_SXM_80GB, 1), A100_SXM_80GB.bf16FlopsPerSec); // no FP8 tensor cores
  assert.equal(matmulPeakFlopsPerSec(H100_SXM, 1), H100_SXM.fp8FlopsPerSec);
  assert.equal(matmulPeakFlopsPerSec(H100_SXM, 2), H100_SXM.bf16FlopsPerSec);
});

test('profiles are found by id or alias; unknown names list the known ones', () => {
  assert.equal(getHardwareProfile('H100'), H100_SXM);
  assert.equal(getHardwareProfile('a100-80gb'), A100_SXM_80GB);
  assert.throws(() => getHardwareProfile('v100'), /known: h100, h200, a100, b200/);
  assert.throws(() => getLinkProfile('ethernet'), RangeError);
});
