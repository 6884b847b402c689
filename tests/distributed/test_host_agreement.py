"""Agreement on the host (``HostAgreement``): several processes on gloo (CPU) and NCCL (GPUs), its arguments, its
shared-memory page (private, made exclusively, reserved before use), and a rank's check of what the group agreed."""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.distributed import HostAgreement
from cgregistry.errors import AgreementError
from cgregistry.testing import make_plugins

from tests import agreement_worker

ROOT = Path(__file__).parent.parent.parent


def _spawn(comm: str, world: int, tmp_path: object) -> None:
    init_file = str(tmp_path / "init")  # type: ignore[operator]
    mp.start_processes(agreement_worker.main, args=(world, comm, init_file), nprocs=world, join=True, start_method="spawn")


@pytest.mark.slow  # spawned processes, each importing torch
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_agree_on_the_host_refuse_different_batches_and_a_late_rank(world: int, tmp_path: object,
                                                                          capfd: pytest.CaptureFixture[str]) -> None:
    _spawn("gloo", world, tmp_path)
    # the ranks, spawned from this process, share its resource tracker: it was never told of the pages
    err = capfd.readouterr().err
    assert "resource_tracker" not in err and "leaked" not in err, err


RANK = """
import sys
import torch.distributed as dist
from cgregistry import BatchDescriptor as B
from cgregistry.distributed import HostAgreement

dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=int(sys.argv[1]), world_size=2)
agreement = HostAgreement(same_batch=True, transport="shm")
assert agreement.agree(B.decode(3)) == B.decode(3)
dist.destroy_process_group()
"""


@pytest.mark.slow  # two processes, each importing torch
def test_ranks_of_their_own_leave_nothing_behind_at_exit(tmp_path: Path) -> None:
    """Two ranks started apart (as torchrun starts them, each with a resource tracker of its own, if any) meet in the
    page and exit: no tracker warns of a leaked segment or unlinks one, and /dev/shm holds nothing of theirs."""
    before = set(os.listdir("/dev/shm"))
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(tmp_path / "init")], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(2)]
    for rank in ranks:
        out, err = rank.communicate(timeout=300)
        assert rank.returncode == 0 and err == "", (rank.returncode, out, err)
    assert not {n for n in set(os.listdir("/dev/shm")) - before if n.startswith("cgregistry")}


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_ranks_agree_on_the_host_with_nccl(tmp_path: object) -> None:
    _spawn("nccl", 2, tmp_path)


def test_it_needs_torch_distributed() -> None:
    with pytest.raises(RuntimeError, match="needs torch.distributed to be initialised"):
        HostAgreement()


# --------------------------------------------------------------------------- the page, and what a rank replays


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[object]:
    """A gloo process group of one rank in this process: a HostAgreement meets itself, on either transport."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_the_page_is_made_exclusively_for_this_user_alone_and_unlinked(one_rank_group: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mode 0600 whatever the umask (another user cannot read it), a second create of its name fails, and the name is
    gone once every rank has mapped the page.  Looked at while the ranks learn its name, the one moment it has one."""
    seen = []
    broadcast = dist.broadcast_object_list

    def spy(objects: list[Any], *args: Any, **kwargs: Any) -> None:
        broadcast(objects, *args, **kwargs)
        for name in (o for o in objects if isinstance(o, str) and "cgregistry" in o):
            path = name if name.startswith("/") else os.path.join("/dev/shm", name)
            other_user = subprocess.run(["cat", path], user=65534, capture_output=True) if os.geteuid() == 0 else None
            with pytest.raises(FileExistsError):
                shared_memory.SharedMemory(os.path.basename(path), create=True, size=8)
            seen.append((path, stat.S_IMODE(os.stat(path).st_mode), other_user))

    monkeypatch.setattr(dist, "broadcast_object_list", spy)
    old_umask = os.umask(0o002)  # a group-writable default: the page must not follow it
    try:
        agreement = HostAgreement(one_rank_group, transport="shm")
    finally:
        os.umask(old_umask)
    [(path, mode, other_user)] = seen
    assert mode == 0o600, oct(mode)
    if other_user is not None:  # root here: a process of another user tries to read it
        assert other_user.returncode != 0 and b"Permission denied" in other_user.stderr, other_user
    assert not os.path.exists(path)
    assert agreement.agree(B.decode(2)) == B.decode(2)


def _no_room(reserved: list[str]) -> Callable[[int, int, int], None]:
    def posix_fallocate(fd: int, offset: int, length: int) -> None:
        reserved.append(os.readlink(f"/proc/self/fd/{fd}"))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return posix_fallocate


def test_a_full_dev_shm_falls_back_to_the_group_and_says_why(one_rank_group: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """/dev/shm without room for the page: 'auto' agrees over the gloo group and says why; 'shm' is refused naming
    the cause; the segment made is unlinked.  (The real thing, a full tmpfs, is the test below.)"""
    reserved: list[str] = []
    monkeypatch.setattr(os, "posix_fallocate", _no_room(reserved))
    agreement = HostAgreement(one_rank_group, same_batch=True)
    assert agreement.transport == "group"
    assert "rank 0 could not make a shared-memory page of 144 bytes (/dev/shm is full" in agreement.shm_refused
    assert "/dev/shm is full" in repr(agreement)
    assert agreement.agree(B.decode(3)) == B.decode(3)
    with pytest.raises(ValueError, match=r"transport='shm'\): rank 0 could not make a shared-memory page .*/dev/shm is full"):
        HostAgreement(one_rank_group, transport="shm")
    assert len(reserved) == 2 and not any(os.path.exists(p) for p in reserved)


FULL_SHM = """
import tempfile
import torch.distributed as dist
from cgregistry import BatchDescriptor as B
from cgregistry.distributed import HostAgreement

filler = open("/dev/shm/filler", "wb", buffering=0)
try:
    while True:
        filler.write(bytes(4096))
except OSError as exc:
    print("filled:", exc.strerror)
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
agreement = HostAgreement(same_batch=True)
print(agreement.transport, agreement.agree(B.decode(2)), agreement.shm_refused)
try:
    HostAgreement(transport="shm")
except ValueError as exc:
    print(exc)
dist.destroy_process_group()
"""


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _can_unshare(), reason="needs user and mount namespaces (unshare -rm) for a tmpfs of its own")
def test_a_full_dev_shm_never_kills_the_process() -> None:
    """A real /dev/shm with no room left (a 64 KiB tmpfs of its own, filled): building the agreement falls back to the
    group, where a sparse page's first write would have killed the process with SIGBUS."""
    mounted = 'mount -t tmpfs -o size=64k tmpfs /dev/shm && exec "$0" -c "$1"'
    done = subprocess.run(["unshare", "-rm", "sh", "-c", mounted, sys.executable, FULL_SHM], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)
    lines = done.stdout.splitlines()
    assert lines[0] == "filled: No space left on device", lines
    assert lines[1].startswith("group Batch(tokens=2, reqs=2, uniform) rank 0 could not make a shared-memory page"), lines
    assert "/dev/shm is full" in lines[1] and "/dev/shm is full" in lines[2], lines
    assert lines[2].startswith("HostAgreement(transport='shm'): rank 0 could not make"), lines


def test_a_group_that_is_not_gloo_is_refused_naming_its_backend(one_rank_group: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """transport='group' needs a gloo group and says so, before trying anything; 'auto' on such a group, where the
    page cannot be made, names both causes."""
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(ValueError, match=r"transport='group'\) agrees by one all-reduce a step on the CPU, which needs a "
                                         r"gloo group .*; this group's backend is 'nccl'") as refused:
        HostAgreement(one_rank_group, transport="group")
    assert "shared" not in str(refused.value)
    monkeypatch.setattr(os, "posix_fallocate", _no_room([]))
    with pytest.raises(ValueError, match=r"cannot meet in shared memory \(rank 0 could not make a shared-memory page of "
                                         r"144 bytes \(/dev/shm is full.*\), and the other way, .* needs a gloo group"):
        HostAgreement(one_rank_group)


class Told(HostAgreement):
    """An agreement that answers what it was told, whatever the ranks brought: a tampered page, a peer's bug."""

    def __init__(self, agreed: B) -> None:
        self.agreed = agreed

    def agree(self, actual: B) -> B:
        return self.agreed


@pytest.mark.parametrize(("own", "agreed"), [
    (B(12), B(4)),  # fewer tokens: a replay would hand back 4 rows of 12
    (B(4, 2), B.decode(4)),  # a uniform key for a mixed batch
    (B(8, 8), B(8, 8, num_ubatches=2)),  # another micro-batch split
])
def test_a_rank_replays_nothing_for_an_agreed_descriptor_that_does_not_cover_its_batch(own: B, agreed: B) -> None:
    w = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
    reg = cg.GraphRegistry(lambda b, x: torch.tanh(x @ w), {"x": cg.StaticInput((16, 8), torch.float32)}, backend="cpu",
                           plugins=make_plugins())
    reg.capture([(B(4), "full"), (B(16), "full"), (B.decode(4), "full"), (B(8, 8, num_ubatches=2), "full")])
    x = torch.randn(own.num_tokens, 8)
    named = rf"the group agreed on {re.escape(str(agreed))}, which does not cover this rank's own batch {re.escape(str(own))}"
    with pytest.raises(AgreementError, match=named + "; nothing was replayed"):
        reg.run(own, x=x, group=Told(agreed))
    with pytest.raises(AgreementError, match=named):
        reg.match(own, group=Told(agreed))
    assert reg.stats().hits == 0 and sum(e.replays for e in reg.entries()) == 0
    # an agreed descriptor that covers the batch is served, the batch's own rows back
    out = reg.run(own, x=x, group=Told(B(16)))
    torch.testing.assert_close(out, torch.tanh(x @ w))
    assert reg.stats().hits == 1
