"""pdserve's HTTP servers as their tests start and check them: a `pdserve serve` process waited for
until it serves, and the text local mode generates for a prompt (what a server must answer)."""

import subprocess
from pathlib import Path

import httpx

from deploy.config import EngineConfig
from deploy.driver import open_engine
from deploy.params import GenerationParams
from deploy.prompts import encode_prompt
from tests.waiting import wait_for


def wait_ready(proc: subprocess.Popen, base: str, log: Path, timeout_s: float = 240) -> None:
    """Wait until `pdserve serve` (`proc`, writing `log`) says its app is up, and check that it
    answers; fails at once if the process exits."""

    def up() -> bool:
        assert proc.poll() is None, (
            f"pdserve serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
        )
        return "Ctrl-C stops it." in log.read_text()  # printed once the app is up

    wait_for(
        up,
        timeout_s,
        what="pdserve serve to say its app is up",
        poll_s=0.5,
        context=lambda: log.read_text()[-3000:],
    )
    assert httpx.get(f"{base}/v1/models", timeout=10).status_code == 200


def local_text(checkpoint, prompt=None, messages=None, max_tokens=12, prompt_token_ids=None):
    """Greedy local mode's (text, prompt tokens, output tokens, finish reason) for a prompt."""
    with open_engine(EngineConfig(model=checkpoint, max_model_len=256)) as engine:
        ids = encode_prompt(
            engine.tokenizer, prompt=prompt, messages=messages, prompt_token_ids=prompt_token_ids
        )
        request = GenerationParams(temperature=0).request(
            "x",
            ids,
            max_tokens=max_tokens,
            eos_token_ids=engine.eos_token_ids,
            vocab_size=len(engine.tokenizer),
        )
        done = engine.run([request])["x"]
    return done.text, done.prompt_tokens, len(done.token_ids), done.finish_reason
