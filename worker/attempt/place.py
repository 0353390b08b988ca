"""Stage 1, place: what one attempt's share of its worker (worker/devices.py share) means for its processes."""

from dataclasses import dataclass

from service.scheduling import placement
from trainjobs.spec import JobSpec
from worker import devices, sandbox

MIN_MEMORY_BYTES = 2**28  # the least host memory a share is bounded to, however small its part of the worker


@dataclass(frozen=True)
class Placed:
    """Its devices on a shared worker (`share`), or the whole worker (None), as its launch applies them."""

    share: dict | None
    device: str  # the spec's resources.device: "cpu" binds no GPU node

    @classmethod
    def of(cls, share: dict | None, spec: JobSpec) -> "Placed":
        return cls(share, spec.resources.device)

    @property
    def cores(self) -> list[int]:
        """The cores its ranks are pinned to: its share's (a CPU job's slots, a GPU job's NUMA nodes), or none."""
        return list(self.share.get("cores") or []) if self.share is not None else []

    @property
    def uuids(self) -> list[str]:
        return list(self.share.get("uuids") or []) if self.share is not None else []

    @property
    def gpus(self) -> list[tuple[int, str]]:
        """(index, UUID) of each of its GPUs nvidia-smi named: those whose health its attempt watches."""
        if self.share is None or self.share.get("kind") != "cuda":
            return []
        return [(i, u) for i, u in zip(self.share["devices"], self.uuids, strict=False) if devices.is_gpu_uuid(u)]

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """`base` with its own GPUs visible: by UUID, so a rank's cuda:0 is its first own GPU."""
        env = dict(base)
        if self.share is not None and self.share.get("kind") == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = self.share["visible"]
        return env

    def device_nodes(self) -> tuple[str, ...]:
        """The GPU device nodes its sandbox binds: its own GPUs' where they can be told apart, else every one."""
        if self.device == "cpu":
            return ()
        if self.uuids:
            own = devices.gpu_device_nodes(self.uuids)
            if own is not None:
                return (*own, *(n for n in sandbox.gpu_nodes() if not n.removeprefix("/dev/nvidia").isdigit()))
        return sandbox.gpu_nodes()

    def memory_bytes(self, total: int) -> int:
        """Its host-memory bound out of `total` (what the worker gives jobs): on a shared worker, its devices'
        share of it."""
        if self.share is None or not self.share.get("of"):
            return total
        return max(MIN_MEMORY_BYTES, total * len(self.share["devices"]) // self.share["of"])

    def describe(self, attempt: int, box: sandbox.Box) -> str:
        """The log's first line: where the attempt runs and what bounds it (or that nothing does)."""
        where = f"[trainjobs] attempt {attempt} on {self.share['worker'] if self.share else 'its worker'}"
        if self.share is not None:
            noun = "GPU" if self.share.get("kind") == "cuda" else "slot"
            where += f": {noun}(s) {','.join(map(str, self.share['devices']))}"
            if self.uuids:
                where += f" ({','.join(self.uuids)})"
        if self.cores:
            held = box.cgroup is not None and box.cgroup.cpuset
            where += f", cores {placement.cpulist(self.cores)} ({'cpuset' if held else 'affinity only'})"
        if box.cgroup is not None:
            where += f", memory bound {box.memory_bytes / 2**30:.1f} GiB ({box.cgroup.version} cgroup)"
        else:
            where += ", no memory bound (this worker cannot make cgroups)"
        return where + "\n"
