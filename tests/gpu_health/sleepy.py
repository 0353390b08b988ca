"""A job that only waits: it stands in for a GPU job on a worker whose GPUs are a fake nvidia-smi's."""

import os
import time

print(f"up on {os.environ.get('CUDA_VISIBLE_DEVICES')}", flush=True)
while True:
    time.sleep(0.2)
