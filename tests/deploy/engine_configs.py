"""The engine settings the Ray modes' tests run with, the requests they run, and the local mode
they are compared with."""

from tests.factories import TEST_DEVICE, TEST_GPUS_PER_WORKER, VOCAB, make_requests

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

PROMPTS, OUTPUTS = [5, 31, 12, 47, 9, 20, 3, 60, 15], [17, 6, 25, 9, 3, 12, 30, 8, 14]


def requests(sampling=None):
    return make_requests(
        9, PROMPTS, OUTPUTS, sampling=sampling, stop_token_ids=frozenset({VOCAB - 1})
    )
