"""The engine settings the Ray modes' tests run with, and the local mode they are compared with."""

from tests.factories import TEST_DEVICE, TEST_GPUS_PER_WORKER

BASE = dict(
    slots=3,
    max_model_len=160,
    token_budget=16,
    prefill_chunk=8,
    prefill_slots=2,
    device=TEST_DEVICE,  # PDSERVE_TEST_DEVICE (cpu by default)
    gpus_per_worker=TEST_GPUS_PER_WORKER,
    dtype="float32",  # (auto is bf16 on a GPU)
)
