"""zipccl.topology without processes: each launcher's variables, the override, the host-name
fallback, disagreement, uneven nodes, NVML absent."""

from __future__ import annotations

import socket

import pytest
import torch

from zipccl import MismatchError, UnsupportedError
from zipccl.topology import Topology, claim, from_claims, nvml_link, parse

SRC = {"ZIPCCL_TOPOLOGY": 0, "torchrun": 1, "mpirun": 2, "slurm": 3, "hostname": 4}


def rows(claims, override=(-1, -1)):
    """Rows as the ranks exchange them: [override N, M, source, node key, local rank, local size]."""
    return [[*override, SRC[c[0]], *c[1:]] for c in claims]


def test_torchrun_variables():
    assert claim({"GROUP_RANK": "1", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4", "RANK": "6"}) == ("torchrun", 1, 2, 4)


def test_open_mpi_variables_name_the_node_by_host():
    """OMPI_COMM_WORLD_NODE_RANK is a rank within the node (Open MPI's docs), not the node: four
    ranks of one host (NODE_RANK 0-3) are one node (with it as the node, mpirun -np 4 raised
    MismatchError)."""
    env = {"OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    source, node, local, size = claim({**env, "OMPI_COMM_WORLD_NODE_RANK": "3"})
    assert (source, local, size) == ("mpirun", 1, 4) and node == claim({})[1]
    rows = [[-1, -1, 2, claim({**env, "OMPI_COMM_WORLD_NODE_RANK": str(r)})[1], r, 4] for r in range(4)]
    assert from_claims(rows).nodes == ((0, 1, 2, 3),)


def test_slurm_variables():
    assert claim({"SLURM_NODEID": "5", "SLURM_LOCALID": "0"}) == ("slurm", 5, 0, -1)


def test_host_name_fallback():
    source, node, local, size = claim({})
    assert source == "hostname" and (local, size) == (-1, -1)
    assert node == claim({})[1] and node >= 0  # stable, and the same for every rank of this host
    assert socket.gethostname()  # what it is derived from


def test_nodes_from_launcher_claims():
    # 2 nodes of 3: torchrun's GROUP_RANK, local ranks in order
    topo = from_claims(rows([("torchrun", n, j, 3) for n in range(2) for j in range(3)]))
    assert topo.nodes == ((0, 1, 2), (3, 4, 5)) and topo.hierarchical and topo.local_size == 3
    assert topo.node_of(4) == 1 and topo.local_rank(4) == 1 and str(topo).startswith("2x3")
    # interleaved placement (round-robin): nodes still found by their key
    topo = from_claims(rows([("slurm", r % 2, r // 2, -1) for r in range(4)]))
    assert topo.nodes == ((0, 2), (1, 3))


def test_override_wins_and_must_fit():
    topo = from_claims(rows([("hostname", 7, -1, -1)] * 4, override=(2, 2)))
    assert topo.nodes == ((0, 1), (2, 3)) and topo.source == "ZIPCCL_TOPOLOGY"
    with pytest.raises(MismatchError, match="describes 6 ranks, the job has 4"):
        from_claims(rows([("hostname", 7, -1, -1)] * 4, override=(2, 3)))
    # a group of some of the job's ranks: its nodes are those of its ranks in the job
    two = rows([("hostname", 7, -1, -1)] * 2, override=(2, 2))
    assert from_claims(two, ranks=[1, 3], world=4).nodes == ((0,), (1,))
    assert from_claims(two, ranks=[2, 3], world=4).nodes == ((0, 1),)
    with pytest.raises(MismatchError, match="describes 4 ranks, the job has 6"):
        from_claims(two, ranks=[0, 1], world=6)
    assert parse("2x4") == (2, 4) and parse(" 1X8 ") == (1, 8)
    for bad in ("2", "2x0", "x4", "2*4"):
        with pytest.raises(ValueError):
            parse(bad)


def test_disagreement_raises():
    r = rows([("hostname", 7, -1, -1)] * 4, override=(2, 2))
    r[3][:2] = [-1, -1]  # one rank without the override
    with pytest.raises(MismatchError, match="ZIPCCL_TOPOLOGY"):
        from_claims(r)
    with pytest.raises(MismatchError, match="different ways"):
        from_claims(rows([("torchrun", 0, 0, 2), ("torchrun", 0, 1, 2), ("hostname", 9, -1, -1),
                          ("hostname", 9, -1, -1)]))
    with pytest.raises(MismatchError, match="local ranks"):  # two ranks claim local rank 0 on one node
        from_claims(rows([("torchrun", 0, 0, 2), ("torchrun", 0, 0, 2), ("torchrun", 1, 0, 2),
                          ("torchrun", 1, 1, 2)]))


def test_ranks_spawned_under_one_slurm_task_share_its_local_id_and_keep_their_nodes():
    """mp.spawn under one srun task per node: every child inherits SLURM_LOCALID 0, and its
    SLURM_NODEID still tells the nodes (a launcher that repeats local ranks is refused above)."""
    topo = from_claims(rows([("slurm", r // 2, 0, -1) for r in range(4)]))
    assert topo.nodes == ((0, 1), (2, 3)) and topo.source == "slurm" and topo.hierarchical


def test_uneven_and_single_level_topologies_have_no_hierarchy():
    uneven = from_claims(rows([("slurm", 0, 0, -1), ("slurm", 0, 1, -1), ("slurm", 0, 2, -1), ("slurm", 1, 0, -1)]))
    assert uneven.nodes == ((0, 1, 2), (3,)) and not uneven.uniform and not uneven.hierarchical
    with pytest.raises(UnsupportedError, match="different numbers"):
        uneven.local_size
    assert not Topology(((0, 1, 2, 3),), "hostname").hierarchical          # one node
    assert not Topology(((0,), (1,), (2,), (3,)), "hostname").hierarchical  # one rank per node


def test_nvml_absent_is_a_normal_case():
    """Without a GPU (or NVML) the link is "unknown", without raising; with one, a known kind."""
    assert nvml_link() in (("unknown", "pcie", "nvlink") if torch.cuda.is_available() else ("unknown",))
