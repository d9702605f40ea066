"""The in-process engine on a tiny model, as the engine's tests build it."""

from tests.factories import TEST_DEVICE, local_engine, tiny_model

CAPACITY = 256


def make_engine(kind="llama", num_slots=3, token_budget=16, prefill_chunk=8, tokenizer=None):
    return local_engine(
        tiny_model(kind, TEST_DEVICE),
        num_slots,
        CAPACITY,
        token_budget=token_budget,
        prefill_chunk=prefill_chunk,
        tokenizer=tokenizer,
    )
