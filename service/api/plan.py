"""POST /v1/plan: the memory plan for a job spec, without creating a job."""

from fastapi import APIRouter

from service.deps import SessionDep, SettingsDep
from service.errors import responses
from service.jobs import service
from service.workers import service as worker_rows
from trainjobs import plan
from trainjobs.spec import JobSpec

router = APIRouter(prefix="/v1/plan", tags=["plan"])


@router.post("", response_model=plan.Plan, responses=responses(400, 413))
def plan_job(spec: JobSpec, db: SessionDep, settings: SettingsDep) -> plan.Plan:
    """Both estimates, the choice and the reason. Nothing fitting is an answer here (choice null), not an error:
    only submitting such an "auto" job is refused."""
    service.check_inputs(spec, data_dir=settings.data_dir, hidden=settings.service_paths)
    workers = worker_rows.memory_for(db, spec=spec, lost_after_s=settings.lease_s)
    return plan.make_plan(spec, workers)
