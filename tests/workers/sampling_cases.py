"""Requests that ask for every logit processor (penalties, logit_bias, min_tokens, min_p,
log-probs), as the sampling tests and the modes' parity tests run them."""

from scheduler.request import Request, SamplingParams
from tests.factories import VOCAB, prompt_ids

EOS = VOCAB - 1


def request(req_id: str, prompt_len: int, max_tokens: int, prompt_seed: int, **params) -> Request:
    return Request(
        req_id=req_id,
        prompt_ids=prompt_ids(prompt_len, prompt_seed),
        max_tokens=max_tokens,
        sampling=SamplingParams(**params),
        stop_token_ids=frozenset({EOS}),
    )


def processed_requests() -> list[Request]:
    suppress = frozenset({EOS})
    return [
        request("presence", 12, 14, 11, presence_penalty=1.5, prompt_logprobs=1, logprobs=1),
        request("frequency", 25, 14, 12, frequency_penalty=0.8),
        request("repetition", 9, 14, 13, repetition_penalty=1.3),
        request(
            "all",
            18,
            12,
            14,
            presence_penalty=-0.5,
            frequency_penalty=0.4,
            repetition_penalty=0.8,
            logit_bias=((7, 5.0), (100, -100.0)),
        ),
        request("bias", 7, 10, 15, logit_bias=((42, 8.0), (43, 6.0))),
        # EOS pushed to the top: without min_tokens it would stop at once
        request(
            "min_tokens", 10, 20, 16, min_tokens=6, suppress_ids=suppress, logit_bias=((EOS, 30.0),)
        ),
        request(
            "sampled",
            15,
            12,
            17,
            temperature=0.8,
            top_k=50,
            seed=5,
            frequency_penalty=1.0,
            presence_penalty=0.5,
            repetition_penalty=1.2,
            logit_bias=((9, 3.0),),
        ),
        request("plain", 20, 10, 18),
        request("min_p", 11, 12, 20, temperature=1.3, min_p=0.2, seed=9),
    ]
