"""The flags of a worker group spanning hosts and of an uneven pipeline split (issue 36): their
errors name the flag and the values, their PAGEDSERVE_* (and vLLM's VLLM_PP_LAYER_PARTITION)
variables set them, ``serve`` forwards them to the worker only, and refuses several hosts."""

from __future__ import annotations

import argparse

import pytest

from services.cli.flags import forwarded_argv, serve_parser
from services.cli.launcher import run_stack
from services.cli.ranks import local_ranks
from services.worker import server as worker_server
from services.worker.parallel.rendezvous import rendezvous_address


@pytest.mark.parametrize(("argv", "message"), [
    (["--pipeline-layer-partition", "3;2"], "--pipeline-layer-partition '3;2': must be "
                                            "comma-separated layer counts"),
    (["--pipeline-layer-partition", "0,5"], "every stage needs at least 1 layer"),
    (["--nnodes", "0"], "argument --nnodes: must be >= 1, got 0"),
    (["--node-rank", "-1"], "argument --node-rank: must be >= 0, got -1"),
])
def test_bad_values_name_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit):
        serve_parser().parse_args(argv)
    assert message in capsys.readouterr().err


def test_partition_from_vllm_or_pagedserve_variable(monkeypatch):
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "10,20")
    assert serve_parser().parse_args([]).pipeline_layer_partition == "10,20"
    monkeypatch.setenv("PAGEDSERVE_PIPELINE_LAYER_PARTITION", "20,10")  # ours wins
    assert serve_parser().parse_args([]).pipeline_layer_partition == "20,10"
    monkeypatch.setenv("PAGEDSERVE_PIPELINE_LAYER_PARTITION", "x")
    with pytest.raises(SystemExit):
        serve_parser()


def test_serve_forwards_the_host_flags_to_the_worker_only():
    ns = serve_parser().parse_args(["--pipeline-layer-partition", "1,2", "--dist-init-addr",
                                    "10.0.0.1:29500", "--advertise-host", "a.example"])
    argv = forwarded_argv("worker", ns)
    for flag, value in (("--pipeline-layer-partition", "1,2"),
                        ("--dist-init-addr", "10.0.0.1:29500"),
                        ("--advertise-host", "a.example"), ("--nnodes", "1")):
        assert argv[argv.index(flag) + 1] == value
    for name in ("scheduler", "router"):
        assert "--pipeline-layer-partition" not in forwarded_argv(name, ns)


def test_serve_refuses_several_hosts_and_a_partition_of_other_stages(capsys):
    ns = serve_parser().parse_args(["--nnodes", "2", "--pipeline-parallel-size", "2"])
    assert run_stack(ns, {}) == 1
    assert "--nnodes 2: serve runs every rank on this host" in capsys.readouterr().err
    ns = serve_parser().parse_args(["--pipeline-layer-partition", "1,2"])
    assert run_stack(ns, {}) == 1
    assert ("--pipeline-layer-partition 1,2 has 2 stages but --pipeline-parallel-size is 1"
            in capsys.readouterr().err)


def _worker(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    worker_server.add_args(p)
    return p.parse_args(argv)


def test_each_host_starts_its_share_of_the_ranks():
    tp2pp2 = ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2",
              "--dist-init-addr", "h0:29500", "--nnodes", "2"]
    assert local_ranks(_worker([*tp2pp2, "--node-rank", "1"])) == range(2, 4)
    assert local_ranks(_worker(["--tensor-parallel-size", "4"])) == range(4)
    with pytest.raises(ValueError, match="--nnodes 3 must divide the world size 4"):
        local_ranks(_worker([*tp2pp2, "--nnodes", "3"]))
    with pytest.raises(ValueError, match="--node-rank 2 must be below --nnodes 2"):
        local_ranks(_worker([*tp2pp2, "--node-rank", "2"]))
    with pytest.raises(ValueError, match="--nnodes 2: give every host --dist-init-addr"):
        local_ranks(_worker(["--pipeline-parallel-size", "2", "--nnodes", "2"]))


def test_rendezvous_address(monkeypatch):
    assert rendezvous_address("10.1.2.3:29500") == ("10.1.2.3", 29500)
    assert rendezvous_address("[::1]:29500") == ("::1", 29500)
    with pytest.raises(ValueError, match="--dist-init-addr 'h0': must be HOST:PORT"):
        rendezvous_address("h0")
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ValueError, match="needs --dist-init-addr HOST:PORT"):
        rendezvous_address(None)
    monkeypatch.setenv("MASTER_PORT", "1234")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert rendezvous_address(None) == ("127.0.0.1", 1234)


def test_a_partition_with_another_stage_count_is_refused_before_any_rank_starts():
    from services.worker.server import world_size
    with pytest.raises(ValueError, match="--pipeline-layer-partition 1,2,3 has 3 stages but "
                                         "--pipeline-parallel-size is 2"):
        world_size(_worker(["--pipeline-parallel-size", "2", "--pipeline-layer-partition",
                            "1,2,3"]))
    assert world_size(_worker(["--pipeline-parallel-size", "2", "--pipeline-layer-partition",
                               "1,2"])) == 2
