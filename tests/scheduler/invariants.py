"""What every step of a `StepPlanner` keeps, checked by the planner's tests after each plan."""

from scheduler.plan import StepPlan
from scheduler.step_planner import StepPlanner


def check_invariants(sched: StepPlanner, plan: StepPlan) -> None:
    assert plan.num_tokens <= sched.token_budget
    used = [r.slot for r in sched.running]
    assert len(used) == len(set(used)), "two requests share a slot"
    assert not set(used) & set(sched.free_slots), "a used slot is also free"
    assert len(used) + len(sched.free_slots) == sched.num_slots, "a slot leaked"
    assert all(c.num_tokens <= sched.prefill_chunk for c in plan.prefill)
    ids = [c.req_id for c in plan.chunks]
    assert len(ids) == len(set(ids)), "a request got two chunks in one step"
