"""The dashboard: one static page (HTML, one JS, one CSS) that reads the same /v1 API as curl and the CLI.

No build step and no dependency: the page polls and streams the API with fetch() and draws its charts as
hand-written SVG. It holds no data itself, so it needs no auth; every /v1 call it makes carries the token the
user typed in (kept in localStorage).
"""

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).parent / "static"

router = APIRouter(include_in_schema=False)
router.mount("/dashboard/static", StaticFiles(directory=STATIC), name="dashboard-static")


@router.get("/")
def index() -> FileResponse:
    """The page itself; the views (jobs, one job, workers) are #/ routes inside it."""
    return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})
