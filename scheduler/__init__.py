"""Pure scheduling policy (stdlib only): requests, step plans and the decode-first planner."""

from scheduler.plan import Chunk, StepPlan
from scheduler.request import (
    OPENAI_FINISH_REASON,
    FinishReason,
    Request,
    RequestStatus,
    SamplingParams,
)
from scheduler.step_planner import QueueFullError, StepPlanner

__all__ = [
    "Chunk",
    "StepPlan",
    "QueueFullError",
    "StepPlanner",
    "OPENAI_FINISH_REASON",
    "FinishReason",
    "Request",
    "RequestStatus",
    "SamplingParams",
]
