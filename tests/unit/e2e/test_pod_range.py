"""Each local cluster's own pod range (e2e/pod_range.py): two clusters on one machine, in one
process or two, never hand out the same pod IPs (with the old fixed 127.1.0.1/16 they did, and a
router reached the other cluster's engine)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from e2e import pod_range

ROOT = Path(__file__).resolve().parents[3]


def test_two_clusters_side_by_side_get_disjoint_ranges(tmp_path):
    first, second = pod_range.reserve(tmp_path), pod_range.reserve(tmp_path)
    assert not first.network.overlaps(second.network), (first.network, second.network)
    assert "127.0.0.1" not in first and "127.0.0.1" not in second  # the host's own loopback stays out
    assert first.kwok_cidr.endswith("/16") and first.kwok_cidr.split("/")[0] in first
    first.release()
    third = pod_range.reserve(tmp_path)  # a stopped cluster's range is free again
    assert third.network == first.network and not third.network.overlaps(second.network)
    second.release()
    third.release()


def test_a_cluster_in_another_process_holds_its_range_until_it_dies(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from e2e import pod_range
        held = pod_range.reserve(Path({str(tmp_path)!r}))
        print(held.network, flush=True)
        sys.stdin.read()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        theirs = holder.stdout.readline().strip()
        ours = pod_range.reserve(tmp_path)
        assert theirs and str(ours.network) != theirs
        ours.release()
    finally:
        holder.kill()  # no clean release: the kernel drops a dead holder's lock
        holder.wait()
    again = pod_range.reserve(tmp_path)
    assert str(again.network) == theirs
    again.release()
