"""The GPU kernels' block choice follows the card built for (``jaxpe.attention.gpu_cards``), not an
H100's shared memory hardcoded: arithmetic only, no GPU nor CUDA plugin (the compiles that check the
same on XLA:GPU and Triton are tests/attention/gpu_compile_test.py's A100 rows).

Reference numbers, independent of the code under test: the CUDA C++ Programming Guide's "maximum
shared memory per thread block" (opt-in) per compute capability, and the bytes Triton asked for at
128-row blocks (XLA's "Shared memory size limit exceeded: requested R" of deviceless compiles,
B 2 x T 256 x N 4). Before the fix the budget was an H100's 232448 bytes on every card: bf16 H 64
with 2 emulation dims took 128-row blocks on an A100, whose Triton gradient asks 167424 bytes of
its 166912 (the compile failed).
"""

import pytest

from jaxpe.attention import flash, gpu_cards, pallas_gpu

GUIDE_KIB = {(8, 0): 163, (8, 6): 99, (8, 9): 99, (9, 0): 227, (10, 0): 227, (7, 5): 64}
"""CUDA C++ Programming Guide, Technical Specifications per Compute Capability: opt-in shared
memory per block, KB (1024 bytes)."""

FLASH_AT_128 = [  # (D, Dv, itemsize, E, bytes Triton asked at 128 rows: the largest kernel measured)
  (128, 128, 2, 0, 98816),
  (256, 256, 2, 0, 229888),
  (128, 128, 4, 0, 262656),
  (64, 64, 2, 2, 167424),
  (128, 128, 2, 2, 199168),
  (64, 64, 4, 0, 198144),
]
PALLAS_AT_128 = [(128, 2, 98816), (256, 2, 229888), (128, 4, 197120)]  # (D, itemsize, bytes)
PALLAS_BACKWARD_AT_32 = [(512, 4, 262528)]  # float32 H 256 + ALiBi emulation dims, padded to 512


def test_the_table_is_the_guides():
  for cc, kib in GUIDE_KIB.items():
    assert gpu_cards.shared_memory(cc) == kib * 1024
  assert gpu_cards.shared_memory("8.0") == 166912  # XLA's a100_sxm_80 spec, "available: 166912"
  assert gpu_cards.shared_memory(gpu_cards.CARDS["h100"]) == 232448  # "available: 232448"


@pytest.mark.parametrize("cc", sorted(GUIDE_KIB))
def test_no_card_gets_a_128_row_block_triton_cannot_hold(cc):
  budget = GUIDE_KIB[cc] * 1024
  for d, dv, itemsize, extra, asked in FLASH_AT_128:
    block = flash.gpu_block(d, dv, itemsize, extra, budget=budget)
    assert block < 128 or asked <= budget, (cc, d, itemsize, extra)
  for d, itemsize, asked in PALLAS_AT_128:
    assert pallas_gpu.forward_block(d, itemsize, budget) < 128 or asked <= budget, (cc, d, itemsize)
  for d, itemsize, asked in PALLAS_BACKWARD_AT_32:
    back = pallas_gpu.forward_block(d, itemsize, budget, cap=pallas_gpu.BACKWARD_BLOCK)
    assert back < 32 or asked <= budget, (cc, d, itemsize)


def test_blocks_do_not_shrink_where_the_card_holds_them():
  """bf16 H 128 (the commonest head) keeps 128-row blocks on an A100: Triton asks 98816 bytes."""
  a100 = gpu_cards.shared_memory("8.0")
  assert flash.gpu_block(128, 128, 2, budget=a100) == 128
  assert pallas_gpu.forward_block(128, 2, a100) == 128


def test_the_card_built_for_picks_the_block():
  with gpu_cards.building_for("8.0"):
    assert gpu_cards.cudnn_max_head_dim() == 128
    a100 = flash.default_block(256, 64, 2, precise_dims=2)
  with gpu_cards.building_for((9, 0)):
    assert gpu_cards.cudnn_max_head_dim() == 256
    h100 = flash.default_block(256, 64, 2, precise_dims=2)
  assert (a100, h100) == (64, 128)


def test_a_malformed_capability_is_refused():
  with pytest.raises(ValueError, match="capability"):
    gpu_cards.shared_memory("sm_80")
