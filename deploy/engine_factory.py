"""Builds the engine a config asks for: the one place that turns an EngineConfig into running parts."""

from __future__ import annotations

import logging

import torch

from deploy.config import EngineConfig
from scheduler.policy import Scheduler
from workers.engine import LocalEngine
from workers.loader import LoadedModel, load_model
from workers.runner import ModelRunner

log = logging.getLogger(__name__)


def build_local_engine(config: EngineConfig, loaded: LoadedModel | None = None) -> tuple[LocalEngine, LoadedModel]:
    """Load the model (unless given) and wrap it in a `local`-mode engine sized by the config."""
    loaded = loaded or load_model(config.model, config.dtype, config.device)
    capacity = config.context_len(loaded.max_context)
    runner = ModelRunner(loaded.model, num_slots=config.slots, capacity=capacity)
    scheduler = Scheduler(config.slots, capacity, config.token_budget, config.prefill_chunk, config.max_waiting,
                          config.max_preemptions)
    log.info("local engine: %s, %d slots x %d tokens, budget %d, chunk %d, torch threads %d", loaded.name,
             config.slots, capacity, config.token_budget, config.prefill_chunk, torch.get_num_threads())
    return LocalEngine(runner, scheduler, loaded.tokenizer), loaded
