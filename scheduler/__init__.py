"""Pure scheduling policy (stdlib only): requests, step plans and the decode-first planner."""

from scheduler.plan import Chunk, StepPlan
from scheduler.policy import QueueFullError, Scheduler
from scheduler.request import OPENAI_FINISH_REASON, FinishReason, Request, RequestStatus, SamplingParams

__all__ = [
    "Chunk", "StepPlan", "QueueFullError", "Scheduler", "OPENAI_FINISH_REASON", "FinishReason",
    "Request", "RequestStatus", "SamplingParams",
]
