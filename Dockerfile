# One image for every trainjobs process: the API (default CMD), `trainjobs worker` and `trainjobs db upgrade`.
#
#   docker build -t trainjobs .
#   docker build -t trainjobs --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 .
#   docker build -t trainjobs --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .   # no GPU
#
# A slim base is enough for GPU workers: the CUDA torch wheels bring the CUDA runtime, cuDNN and NCCL as
# nvidia-* wheels, and the host's NVIDIA Container Toolkit mounts the driver (libcuda) into the container
# when it is started with a GPU (compose: deploy.resources.reservations.devices; docker run: --gpus all).
# Plain Dockerfile syntax (no heredocs, no RUN --mount), so the classic builder builds it as well as BuildKit.
#
# No credentials in the image: Redis's password comes from a secret file named by TRAINJOBS_REDIS_PASSWORD_FILE
# (compose: /run/secrets/redis_password), the database's in TRAINJOBS_DATABASE_URL (compose: the operator's .env).
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

# NVIDIA_DRIVER_CAPABILITIES: what the NVIDIA runtime exposes when a GPU is requested. Which GPUs
# (NVIDIA_VISIBLE_DEVICES) is left to the request, so that a container started without one (the API) gets none.
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    TRAINJOBS_DATA_DIR=/data \
    TRAINJOBS_SECRETS_DIR=/secrets

# bubblewrap: the sandbox around every job (worker/sandbox.py), made from unprivileged user namespaces (Debian's
# bwrap is not setuid); docker-compose.yml says what the worker's container must allow for it. Not pinned: the
# base image's Debian release fixes the version, and its security updates are wanted.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends bubblewrap \
 && bwrap --version \
 && rm -rf /var/lib/apt/lists/*

# The non-root user every process runs as; uid/gid 1000 to match the usual owner of a bind-mounted host dir.
RUN groupadd --system --gid 1000 trainjobs \
 && useradd --system --uid 1000 --gid trainjobs --home-dir /home/trainjobs --create-home \
      --shell /usr/sbin/nologin trainjobs

WORKDIR /app

# 1. torch first, from the CUDA index: the largest layer, and one that changes only with the two ARGs.
#    The constraint (torch==X also matches X+cu128) keeps every later pip call from swapping this build for
#    PyPI's.
RUN echo "torch==${TORCH_VERSION}" > /etc/pip-torch-constraint.txt \
 && pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
 && python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
ENV PIP_CONSTRAINT=/etc/pip-torch-constraint.txt

# 2. The project's dependencies (core + the worker and s3 extras: object storage, TRAINJOBS_STORAGE_URL), read
#    from pyproject.toml alone, so that a change
#    to the code does not reinstall them (README.md: pyproject names it as the readme).
COPY pyproject.toml README.md ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['worker'] + p['optional-dependencies']['s3']))" \
    > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt

# 3. The code, package by package (there is no .dockerignore: nothing else of the context comes in).
COPY trainjobs ./trainjobs
COPY service ./service
COPY worker ./worker
COPY migrations ./migrations
# Everything is installed by now, so this only builds and installs trainjobs itself. The smoke test runs
# with -P (no cwd on sys.path) so that it imports the installed packages, not the copies in /app.
# hadolint ignore=DL3013
RUN pip install '.[worker,s3]' \
 && rm -rf build ./*.egg-info \
 && trainjobs --help > /dev/null \
 && python -P -c "import trainjobs.client, service.api.app, worker.main, worker.agent, worker.train.main, migrations, torch.distributed.run"

# Datasets (job spec paths are relative to it) and the workers' run dirs. Created and chowned before VOLUME,
# so that a new named volume mounted here starts out owned by the trainjobs user. /secrets (the admin token
# file) likewise, 0700; compose mounts a volume there in the API's container only, never in a worker's.
RUN mkdir -p /data /secrets && chown trainjobs:trainjobs /data /secrets && chmod 700 /secrets
VOLUME /data

# Numeric, so that a runtime (Kubernetes runAsNonRoot) can tell it is not root without the image's passwd.
USER 1000:1000
EXPOSE 8000

# For the API (the default CMD); compose turns it off for the worker and the one-shot migrate container.
HEALTHCHECK --interval=30s --timeout=5s --start-period=20s --retries=3 \
  CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4).status != 200)"]

CMD ["trainjobs", "api", "--host", "0.0.0.0", "--port", "8000"]
