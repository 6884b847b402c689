"""Agreement across ranks: every rank of a group replays the same key.

Ranks of a data-parallel group run different batches, but collectives inside the step (an expert-parallel all-to-all, a
tensor-parallel all-reduce) need every rank to run the same graph.  ``agree`` combines the descriptors' encodings with
MAX (``BatchDescriptor.encode``) into the smallest descriptor every rank's batch fits in (uniform only if every rank's
is, at the same spec depth), so every rank matches the same key, provided each captured the same plan: through a process
group (``run(..., group=dp_group)``), one all-reduce (with NCCL, a device sync every step), or a :class:`HostAgreement`
(``run(..., group=agreement)``) on the host (a shared-memory page, else a gloo all-reduce), no device work; its
``same_batch=True`` (tensor parallel) raises :class:`~cgregistry.errors.AgreementError` on every rank when one brought
another descriptor.  ``run`` replays nothing for a batch the agreed descriptor does not cover: an agreement gone wrong
raises instead of truncating outputs.
"""

from __future__ import annotations

import datetime
import errno
import mmap
import os
import secrets
import sys
import time
from array import array
from typing import Any

import torch

from cgregistry.errors import AgreementError
from cgregistry.key.descriptor import BatchDescriptor

__all__ = ["HostAgreement", "agree", "decode_descriptor", "encode_descriptor"]

_FIELDS = len(BatchDescriptor(1).encode())
_LOW = (1 << 32) - 1
_LOWEST, _HIGHEST = -(1 << 31), (1 << 31) - 1  # what one word's low half carries
_PROBE, _GIVEN_UP, _HEADER = 0, 1, 2  # the page's first words: rank 0's probe, the rank that gave up; then the rows


def encode_descriptor(actual: BatchDescriptor) -> list[int]:
    """``actual`` as the integers ``agree()`` all-reduces with MAX (:meth:`BatchDescriptor.encode`)."""
    return actual.encode()


def decode_descriptor(values: list[int]) -> BatchDescriptor:
    """The descriptor of all-reduced integers: one that covers the batch of every rank encoded into them."""
    return BatchDescriptor.from_encoded(values)


def agree(actual: BatchDescriptor, group: Any = None) -> BatchDescriptor:
    """The descriptor covering every rank's ``actual`` in ``group``: a process group (one all_reduce of a few int64s;
    on the current CUDA device for NCCL, on the CPU otherwise) or a :class:`HostAgreement`.  Every rank must call it,
    in the same order as its other collectives."""
    if isinstance(group, HostAgreement):
        return group.agree(actual)
    import torch.distributed as dist

    if not isinstance(actual, BatchDescriptor):
        raise TypeError(f"agree() needs a BatchDescriptor, got {actual!r}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("agree(group=...) needs torch.distributed to be initialised (init_process_group)")
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    values = torch.tensor(encode_descriptor(actual), dtype=torch.int64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return decode_descriptor(values.tolist())


class HostAgreement:
    """Agreement of ``group``'s ranks on the host, for ``run(..., group=agreement)``: no device work, no sync.  Built
    once, collectively, on every rank of ``group``.

    Ranks on one host meet in a shared-memory page (mode 0600, created exclusively, memory reserved, unlinked once every
    rank mapped it), a few microseconds a step; otherwise ``group`` must be a gloo group, one small CPU all-reduce a
    step (``shm_refused`` says why).  ``transport`` forces 'shm' or 'group' (default 'auto'), refused naming why where
    it cannot serve.  ``same_batch``: a rank that brings another descriptor raises ``AgreementError`` on every rank,
    naming each, and the group goes on.  ``timeout``: seconds a rank waits for the others before an ``AgreementError``
    that ends the agreement on every rank (like an NCCL timeout).
    """

    def __init__(self, group: Any = None, *, same_batch: bool = False, timeout: float = 300.0, transport: str = "auto") -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("HostAgreement needs torch.distributed to be initialised (init_process_group)")
        if transport not in ("auto", "shm", "group"):
            raise ValueError(f"transport={transport!r}: expected 'auto', 'shm' (one host) or 'group' (a gloo group)")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout={timeout!r}: expected seconds > 0")
        if not isinstance(same_batch, bool):
            raise TypeError(f"same_batch={same_batch!r}: expected True or False")
        if dist.get_rank(group) < 0:
            raise ValueError(f"HostAgreement: rank {dist.get_rank()} is not a member of the group it was given; build it "
                             "only on the group's ranks")
        self.group, self.same_batch, self.timeout = group, same_batch, float(timeout)
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        backend = str(dist.get_backend(group))
        gloo = "gloo" in backend
        if transport == "group" and not gloo:
            raise ValueError(f"HostAgreement(transport='group') agrees by one all-reduce a step on the CPU, which needs a "
                             f"gloo group (dist.new_group(ranks, backend='gloo')); this group's backend is {backend!r}")
        self._mailbox, why = _Mailbox.open(group, self.rank, self.world) if transport != "group" else (None, "")
        if self._mailbox is None and transport == "shm":
            raise ValueError(f"HostAgreement(transport='shm'): {why}")
        if self._mailbox is None and not gloo:
            raise ValueError(f"HostAgreement: the ranks cannot meet in shared memory ({why}), and the other way, one "
                             "all-reduce a step on the CPU, needs a gloo group (dist.new_group(ranks, backend='gloo')); "
                             f"this group's backend is {backend!r}")
        self.transport = "shm" if self._mailbox is not None else "group"
        self.shm_refused = why or None  # why 'auto' fell back to the group (None: it did not, or did not try)
        self._step = 0
        self._broken: str | None = None  # why an earlier step ended the agreement (a timeout)
        self._decoded: dict[BatchDescriptor, BatchDescriptor] = {}  # what the integers of a descriptor decode to

    def __repr__(self) -> str:
        refused = f" (no shared memory: {self.shm_refused})" if self.shm_refused else ""
        return (f"HostAgreement(rank {self.rank} of {self.world}, {self.transport}{refused}, same_batch={self.same_batch}, "
                f"step {self._step})")

    def agree(self, actual: BatchDescriptor) -> BatchDescriptor:
        """The descriptor covering every rank's ``actual`` (with ``same_batch``: once every rank is seen to have
        brought the same)."""
        if not isinstance(actual, BatchDescriptor):
            raise TypeError(f"agree() needs a BatchDescriptor, got {actual!r}")
        if self._broken is not None:
            raise AgreementError(self._broken)
        self._step += 1
        values = actual.encode()
        if self._mailbox is not None:
            if not (_LOWEST <= min(values) and max(values) <= _HIGHEST):  # the others must not wait for this step
                self._broken = f"HostAgreement step {self._step}: this rank was handed {actual}, too large to agree on"
                self._mailbox.give_up(self._step)
                raise ValueError(f"{actual}: HostAgreement's shared page carries 32-bit integers; this descriptor's "
                                 f"are {values} (the agreement is over on every rank)")
            rows = self._mailbox.exchange(self._step, values, self.timeout)
            if rows is None:
                self._broken = self._late(self._mailbox.late(self._step))
                self._mailbox.give_up(self._step)
                raise AgreementError(self._broken)
            if self._mailbox.given_up(self._step):
                self._broken = self._gave_up()
                raise AgreementError(self._broken)
            if all(row is values for row in rows):  # every rank brought this batch
                return self._decode(actual, values)
            if self.same_batch:
                raise AgreementError(self._differ([BatchDescriptor.from_encoded(row) for row in rows]))
            return BatchDescriptor.from_encoded([max(column) for column in zip(*rows)])
        return self._over_group(actual, values)

    def _decode(self, actual: BatchDescriptor, values: list[int]) -> BatchDescriptor:
        """``actual`` as its integers decode (what the ranks agree on when each brought it), remembered per descriptor."""
        decoded = self._decoded.get(actual)
        if decoded is None:
            if len(self._decoded) >= 1024:
                self._decoded.clear()
            decoded = self._decoded[actual] = BatchDescriptor.from_encoded(values)
        return decoded

    def _over_group(self, actual: BatchDescriptor, values: list[int]) -> BatchDescriptor:
        import torch.distributed as dist

        t = torch.tensor(values + [-v for v in values], dtype=torch.int64)
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        try:
            work.wait(datetime.timedelta(seconds=self.timeout))
        except RuntimeError as exc:
            self._broken = (f"HostAgreement step {self._step}: rank {self.rank} waited {self.timeout:g} s for the "
                            f"group's all-reduce ({exc}); nothing was replayed, and the agreement is over: treat it as "
                            "fatal for the job, as an NCCL timeout is")
            raise AgreementError(self._broken) from exc
        top, low = t[: len(values)].tolist(), [-v for v in t[len(values):].tolist()]
        if self.same_batch and top != low:
            seen: list[Any] = [None] * self.world
            dist.all_gather_object(seen, actual, group=self.group)
            raise AgreementError(self._differ(seen))
        return BatchDescriptor.from_encoded(top)

    def _differ(self, seen: list[BatchDescriptor]) -> str:
        brought = "; ".join(f"rank {r}: {d}" for r, d in enumerate(seen))
        return (f"HostAgreement(same_batch=True) step {self._step}: the ranks were handed different batches ({brought}); "
                "a tensor-parallel group must serve one batch on every rank (nothing was replayed)")

    def _late(self, late: list[int]) -> str:
        return (f"HostAgreement step {self._step}: rank {self.rank} waited {self.timeout:g} s for rank(s) "
                f"{', '.join(map(str, late))} of the group, which did not reach this step (nothing was replayed); the "
                "agreement is over on every rank: treat it as fatal for the job, as an NCCL timeout is (every rank must "
                "call run(..., group=agreement) the same number of times, in the same order)")

    def _gave_up(self) -> str:
        rank, step = self._mailbox.giver()  # type: ignore[union-attr]
        return (f"HostAgreement step {self._step}: rank {rank} of the group gave up at its step {step} (a rank it waited "
                "for was late by more than the timeout, or its own batch was too large to agree on: that rank's error "
                "says which); nothing was replayed here, and the agreement is over on every rank: treat it as fatal "
                "for the job")


class _Mailbox:
    """One shared-memory page where each rank posts its descriptor's integers for a step and reads everyone's.  Each
    8-byte word holds the step number (high half) and one integer (low half), so a row is read only once all its words
    are of the awaited step; two rows a rank by the step's parity (step n+2 is posted only after all read n)."""

    def __init__(self, view: memoryview, rank: int, world: int) -> None:
        self.view, self.rank, self.world = view, rank, world  # the view holds the mapping: unmapped with the last of it

    @classmethod
    def open(cls, group: Any, rank: int, world: int) -> tuple[_Mailbox | None, str]:
        """The group's page mapped on every rank, and ""; or None and why not, the same on every rank.  Rank 0 makes it
        and sends the name; a rank that cannot open it, or reads another probe there, is on another host (or has a
        /dev/shm of its own).  Rank 0 unlinks the name once every rank has tried: nothing is left behind."""
        import torch.distributed as dist

        nbytes = 8 * (2 * world * _FIELDS + _HEADER)
        segment, view, why = None, None, ""
        if rank == 0:
            try:
                segment = _created(nbytes)
            except OSError as exc:
                why = f"rank 0 could not make a shared-memory page of {nbytes} bytes ({_cause(exc)})"
        note: list[Any] = [None if segment is None else segment.name, secrets.randbits(62), why]
        try:
            dist.broadcast_object_list(note, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
            name, probe, why = note
            if name is not None:
                try:
                    view = memoryview(_mapped(name, nbytes)).cast("q")
                    if rank == 0:
                        view[_PROBE] = probe
                except OSError as exc:
                    elsewhere = ": ranks on several hosts, or in containers with a /dev/shm each" if rank else ""
                    why = f"rank {rank} could not map the shared-memory page {name!r} rank 0 made ({_cause(exc)}){elsewhere}"
            dist.barrier(group=group)  # rank 0's probe is written: every rank reads it
            if view is not None and view[_PROBE] != probe:
                why = f"rank {rank} mapped a shared-memory page named {name!r}, but not rank 0's (another host?)"
            whys: list[Any] = [None] * world
            dist.all_gather_object(whys, why, group=group)
        finally:
            if segment is not None:
                segment.unlink()  # every rank holds its mapping (or failed to): the name is no longer needed
        why = next((w for w in whys if w), "")
        if why:
            return None, why
        return cls(view, rank, world), ""  # type: ignore[arg-type]

    def _row(self, step: int, rank: int) -> int:
        return _HEADER + ((step & 1) * self.world + rank) * _FIELDS

    def give_up(self, step: int) -> None:
        """Tell every rank that this one stopped waiting at ``step``: each raises at its next look at the page."""
        self.view[_GIVEN_UP] = ((step & 0x7FFFFFFF) << 32) | (self.rank + 1)

    def given_up(self, step: int) -> bool:
        """Whether a rank gave up at ``step`` or before (one that gave up later had finished ``step``)."""
        word = self.view[_GIVEN_UP]
        return word != 0 and word >> 32 <= (step & 0x7FFFFFFF)

    def giver(self) -> tuple[int, int]:
        word = self.view[_GIVEN_UP]
        return (word & _LOW) - 1, word >> 32

    def exchange(self, step: int, values: list[int], timeout: float) -> list[list[int]] | None:
        """Every rank's integers for ``step`` (None after ``timeout`` seconds without all of them).  A row equal to
        this rank's own is taken at one comparison: the common case, every rank of a tensor-parallel group alike."""
        high = step & 0x7FFFFFFF
        tag = high << 32
        mine = array("q", [tag | (v & _LOW) for v in values])
        view, start = self.view, self._row(step, self.rank)
        view[start : start + _FIELDS] = mine
        own = mine.tolist()
        rows: list[list[int]] = []
        deadline, spins = None, 0
        for r in range(self.world):
            first = self._row(step, r)
            while True:
                words = view[first : first + _FIELDS].tolist()
                if words == own:
                    rows.append(values)
                    break
                if all(w >> 32 == high for w in words):
                    rows.append([(w & _LOW) - ((w & 0x80000000) << 1) for w in words])
                    break
                if view[_GIVEN_UP] and self.given_up(step):  # another rank gave up: this step will not complete
                    return rows
                spins += 1
                if spins > 64:
                    if deadline is None:
                        deadline = time.monotonic() + timeout
                    elif time.monotonic() > deadline:
                        return None
                    time.sleep(0 if spins < 4096 else 50e-6)  # give the core away: ranks may share cores
        return rows

    def late(self, step: int) -> list[int]:
        tag = step & 0x7FFFFFFF
        return [r for r in range(self.world) if any(self.view[self._row(step, r) + i] >> 32 != tag for i in range(_FIELDS))]


_SHM = "/dev/shm"  # where Linux keeps shm_open's objects, each a file named as the object (shm_overview(7))


def _created(nbytes: int) -> Any:
    """A new, closed ``multiprocessing.shared_memory`` segment of ``nbytes`` with its memory reserved: ``unlink()`` it.
    SharedMemory sizes it sparse (ftruncate): with /dev/shm full the first write would SIGBUS, so ``posix_fallocate``
    (through the segment's file) reserves the pages now or fails with ENOSPC.  Untracked on Python 3.13+."""
    from multiprocessing import shared_memory

    track = {"track": False} if sys.version_info >= (3, 13) else {}
    segment = shared_memory.SharedMemory(f"cgregistry-agree-{secrets.token_hex(8)}", create=True, size=nbytes, **track)
    try:
        segment.close()
        fd = os.open(os.path.join(_SHM, segment.name), os.O_RDWR | os.O_NOFOLLOW)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        finally:
            os.close(fd)
    except BaseException:
        segment.unlink()
        raise
    return segment


def _mapped(name: str, nbytes: int) -> mmap.mmap:
    """Rank 0's segment ``name``, mapped here.  Its file is opened as glibc's shm_open opens it, rather than through
    ``SharedMemory(name)``: before Python 3.13 that registers the segment with this process's resource tracker, which
    unlinks it and warns of a leak when the process ends, and stumbles where ranks share one tracker."""
    fd = os.open(os.path.join(_SHM, name), os.O_RDWR | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:  # mapping past its end would raise SIGBUS at the first read
            raise OSError(errno.EINVAL, f"{name!r} holds {size} bytes, not {nbytes}: another object of that name")
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def _cause(exc: OSError) -> str:
    return f"/dev/shm is full: {exc}" if exc.errno == errno.ENOSPC else f"{type(exc).__name__}: {exc}"
