"""Every table, imported in one place so metadata (and Alembic) sees them all."""

from service.auth.models import ApiToken, User
from service.db import Base
from service.images.models import RegistryCredential
from service.jobs.models import Attempt, Job, JobCount, JobCountDelta, JobEvent, JobTag
from service.logs.models import LogChunk
from service.metrics.models import Metric, MetricBlock
from service.packages.models import Package
from service.runners.models import Credential, JoinToken
from service.runners.streams import AttemptStream
from service.scheduling.assignments import Assignment
from service.scheduling.models import Team, Usage
from service.sweeps.models import Sweep
from service.webhooks.models import Delivery, Webhook
from service.workers.models import Hold, Worker

__all__ = ["ApiToken", "Assignment", "Attempt", "AttemptStream", "Base", "Credential", "Delivery", "Hold", "Job",
           "JobCount", "JobCountDelta", "JobEvent", "JobTag", "JoinToken", "LogChunk", "Metric", "MetricBlock",
           "Package", "RegistryCredential", "Sweep", "Team", "Usage", "User", "Webhook", "Worker"]
