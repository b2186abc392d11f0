"""Bad flag values and environment variables end with an argparse error that names the flag (or
the variable) and the allowed range, never a traceback later in start-up."""

from __future__ import annotations

import pytest

from services.cli.flags import serve_parser


@pytest.mark.parametrize(("argv", "message"), [
    (["--block-size", "0"], "argument --block-size: must be in [1, 1024], got 0"),
    (["--port", "70000"], "argument --port: must be in [1, 65535], got 70000"),
    (["--worker-port", "-1"], "argument --worker-port: must be in [1, 65535], got -1"),
    (["--max-model-len", "0"], "argument --max-model-len: must be >= 1, got 0"),
    (["--max-num-seqs", "x"], "argument --max-num-seqs: not an integer: 'x'"),
    (["--gpu-memory-utilization", "2"], "argument --gpu-memory-utilization: must be in (0, 1]"),
    (["--gpu-memory-utilization", "0"], "argument --gpu-memory-utilization: must be in (0, 1]"),
    (["--startup-timeout", "-1"], "argument --startup-timeout: must be > 0, got -1"),
    (["--max-num-waiting-requests", "-1"], "argument --max-num-waiting-requests: must be >= 0"),
    (["--long-prefill-token-threshold", "-5"],
     "argument --long-prefill-token-threshold: must be >= 0"),
    (["--log-level", "banana"], "argument --log-level: invalid choice: 'BANANA'"),
    (["--http-port", "-2"], "argument --http-port: must be in [-1, 65535], got -2"),
    (["--scheduler-connect-timeout", "0"], "argument --scheduler-connect-timeout: must be > 0"),
    (["--shutdown-timeout", "-1"], "argument --shutdown-timeout: must be >= 0, got -1"),
    (["--max-restarts", "-1"], "argument --max-restarts: must be >= 0, got -1"),
    (["--restart-window", "0"], "argument --restart-window: must be > 0, got 0"),
    (["--tool-call-parser", "pythonic"], "argument --tool-call-parser: invalid choice"),
    (["--responses-api-store-size", "0"], "argument --responses-api-store-size: must be >= 1"),
    (["--reasoning-parser", "granite"], "argument --reasoning-parser: invalid choice: 'granite' "
                                        "(choose from 'deepseek_r1', 'qwen3')"),
    (["--max-logprobs", "-2"], "argument --max-logprobs: must be >= -1, got -2"),
    (["--served-model-name"], "argument --served-model-name: expected at least one argument"),
    (["--runner", "embed"], "argument --runner: invalid choice"),
    (["--pooler-config", '{"pooling_type": "MAX"}'],
     "--pooler-config: pooling_type must be one of LAST, MEAN, CLS, got 'MAX'"),
    (["--pooler-config", '{"normalise": true}'], "--pooler-config: unknown field 'normalise'"),
    (["--max-loras", "0"], "argument --max-loras: must be >= 1, got 0"),
    (["--max-lora-rank", "0"], "argument --max-lora-rank: must be >= 1, got 0"),
    (["--lora-modules", "sql"], "argument --lora-modules: expected name=path or a JSON object"),
    (["--cpu-threads", "0"], "argument --cpu-threads: must be >= 1, got 0"),
    (["--cpu-bind", "0-1|3-2"], "argument --cpu-bind: '3-2' is not a CPU range N-M"),
    (["--kv-events-config", '{"buffer_steps": -1}'],
     "argument --kv-events-config: buffer_steps must be an integer >= 1, got -1"),
])
def test_serve_rejects_bad_flags(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        serve_parser().parse_args(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("env", "value", "message"), [
    ("PAGEDSERVE_MAX_NUM_SEQS", "abc", "PAGEDSERVE_MAX_NUM_SEQS='abc': not an integer"),
    ("PAGEDSERVE_ENABLE_PREFIX_CACHING", "maybe", "PAGEDSERVE_ENABLE_PREFIX_CACHING='maybe'"),
    ("PAGEDSERVE_SCHEDULING_POLICY", "lifo", "PAGEDSERVE_SCHEDULING_POLICY='lifo': must be one"),
    ("PAGEDSERVE_REASONING_PARSER", "r1", "PAGEDSERVE_REASONING_PARSER='r1': must be one of "
                                          "('deepseek_r1', 'qwen3')"),
])
def test_bad_environment_variables_name_the_variable(env, value, message, monkeypatch, capsys):
    monkeypatch.setenv(env, value)
    with pytest.raises(SystemExit):
        serve_parser()
    assert message in capsys.readouterr().err


def test_environment_variables_still_set_defaults(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("PAGEDSERVE_ENABLE_PREFIX_CACHING", "off")
    monkeypatch.setenv("PAGEDSERVE_LOG_LEVEL", "debug")
    ns = serve_parser().parse_args([])
    assert (ns.max_num_seqs, ns.enable_prefix_caching, ns.log_level) == (7, False, "DEBUG")


def test_serve_passes_the_shutdown_timeout_to_every_service(monkeypatch):
    from services.cli.flags import forwarded_argv

    ns = serve_parser().parse_args(["--shutdown-timeout", "2.5"])
    for name in ("router", "scheduler", "worker"):
        argv = forwarded_argv(name, ns)
        assert argv[argv.index("--shutdown-timeout") + 1] == "2.5", name
    assert serve_parser().parse_args([]).shutdown_timeout == 30.0
    monkeypatch.setenv("PAGEDSERVE_SHUTDOWN_TIMEOUT", "0")
    assert serve_parser().parse_args([]).shutdown_timeout == 0.0


def test_serve_passes_the_tool_flags_to_the_router_which_needs_both():
    import asyncio

    from services.cli.flags import _service_parser, forwarded_argv
    from services.router.server import serve

    ns = serve_parser().parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    argv = forwarded_argv("router", ns)
    assert "--enable-auto-tool-choice" in argv
    assert argv[argv.index("--tool-call-parser") + 1] == "hermes"
    assert "--tool-call-parser" not in forwarded_argv("worker", ns)
    alone = _service_parser("router").parse_args(["--enable-auto-tool-choice"])
    with pytest.raises(ValueError, match="--enable-auto-tool-choice requires --tool-call-parser"):
        asyncio.run(serve(alone))


def test_serve_passes_the_responses_store_flags_to_the_router(monkeypatch):
    from services.cli.flags import forwarded_argv

    monkeypatch.setenv("PAGEDSERVE_RESPONSES_API_STORE_SIZE", "9")
    ns = serve_parser().parse_args(["--enable-responses-api-store"])
    argv = forwarded_argv("router", ns)
    assert "--enable-responses-api-store" in argv
    assert argv[argv.index("--responses-api-store-size") + 1] == "9"
    assert "--responses-api-store-size" not in forwarded_argv("scheduler", ns)
    monkeypatch.setenv("PAGEDSERVE_ENABLE_RESPONSES_API_STORE", "true")
    assert serve_parser().parse_args([]).enable_responses_api_store is True


def test_serve_passes_the_reasoning_parser_to_the_router(monkeypatch):
    from services.cli.flags import forwarded_argv

    ns = serve_parser().parse_args(["--reasoning-parser", "qwen3"])
    argv = forwarded_argv("router", ns)
    assert argv[argv.index("--reasoning-parser") + 1] == "qwen3"
    assert "--reasoning-parser" not in forwarded_argv("scheduler", ns)
    assert serve_parser().parse_args([]).reasoning_parser is None
    monkeypatch.setenv("PAGEDSERVE_REASONING_PARSER", "deepseek_r1")
    assert serve_parser().parse_args([]).reasoning_parser == "deepseek_r1"


def test_serve_passes_served_model_names_and_max_logprobs_to_the_router(monkeypatch):
    from services.cli.flags import _service_parser, forwarded_argv
    from services.router.served_model import ServedModel

    ns = serve_parser().parse_args(["--served-model-name", "a", "b/c", "--max-logprobs", "5"])
    argv = forwarded_argv("router", ns)
    assert argv[argv.index("--served-model-name"):][:4] == ["--served-model-name", "a", "b/c",
                                                             "--max-logprobs"]
    assert "--served-model-name" not in forwarded_argv("worker", ns)
    router = _service_parser("router").parse_args(argv)
    assert (router.served_model_name, router.max_logprobs) == (["a", "b/c"], 5)
    defaults = serve_parser().parse_args([])
    assert (defaults.served_model_name, defaults.max_logprobs) == (None, 20)
    assert "--served-model-name" not in forwarded_argv("router", defaults)
    monkeypatch.setenv("PAGEDSERVE_SERVED_MODEL_NAME", "x  y")
    monkeypatch.setenv("PAGEDSERVE_MAX_LOGPROBS", "-1")
    env = _service_parser("router").parse_args([])
    assert (env.served_model_name, env.max_logprobs) == (["x", "y"], -1)
    for names in (["a", "a"], ["a", ""]):
        with pytest.raises(ValueError, match="--served-model-name"):
            ServedModel(names)


ENGINE_LIMITS = {"--block-size": "32", "--max-num-seqs": "8", "--max-num-batched-tokens": "128",
                 "--max-model-len": "512"}


def test_serve_passes_the_cpu_flags_to_the_worker_and_reads_vllms_bind(monkeypatch):
    from services.cli.flags import forwarded_argv

    ns = serve_parser().parse_args(["--cpu-threads", "3", "--cpu-bind", "0-2",
                                    "--no-cpu-adaptive-threads"])
    argv = forwarded_argv("worker", ns)
    assert argv[argv.index("--cpu-threads") + 1] == "3"
    assert argv[argv.index("--cpu-bind") + 1] == "0-2"
    assert "--no-cpu-adaptive-threads" in argv
    assert "--cpu-bind" not in forwarded_argv("scheduler", ns)
    assert "--cpu-bind" not in forwarded_argv("worker", serve_parser().parse_args([]))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1|2-3")
    assert serve_parser().parse_args([]).cpu_bind == "0-1|2-3"
    monkeypatch.setenv("PAGEDSERVE_CPU_BIND", "auto")  # ours wins
    assert serve_parser().parse_args([]).cpu_bind == "auto"


def test_serve_passes_the_engine_limits_to_worker_and_scheduler():
    """One flag each on serve; the worker sizes itself by the same values the scheduler pushes
    to it when it connects (a mismatch would be refused)."""
    from services.cli.flags import forwarded_argv

    ns = serve_parser().parse_args([a for kv in ENGINE_LIMITS.items() for a in kv])
    for name in ("worker", "scheduler"):
        argv = forwarded_argv(name, ns)
        assert {flag: argv[argv.index(flag) + 1] for flag in ENGINE_LIMITS} == ENGINE_LIMITS
    assert "--max-num-seqs" not in forwarded_argv("router", ns)


def test_flags_of_both_worker_and_scheduler_have_one_default():
    from services.cli.flags import _WIRING, _service_parser

    def defaults(name):
        return {a.dest: a.default for a in _service_parser(name)._actions if a.option_strings}

    worker, scheduler = defaults("worker"), defaults("scheduler")
    shared = (worker.keys() & scheduler.keys()) - _WIRING  # serve sets ports and addresses
    assert {"block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"} <= shared
    assert {d: worker[d] for d in shared} == {d: scheduler[d] for d in shared}


REPLICA_ROUTING_FLAGS = ("--routing-policy", "--scheduler-dns-refresh", "--prefix-affinity-blocks")


def test_serve_help_offers_no_replica_routing_flags_and_shows_each_default_once():
    import argparse

    from services.cli.flags import _service_parser

    text = serve_parser().format_help()
    for flag in REPLICA_ROUTING_FLAGS:
        assert flag not in text, flag
        assert flag in _service_parser("router").format_help(), flag  # still on the router
    assert "(default: None)" not in text
    # one block per option: from its "  --flag" line to the next
    blocks = [b for b in text.split("\n  -") if b.lstrip("-").split(" ")[0]]
    assert len(blocks) > 30
    for block in blocks:
        assert block.lower().count("default") <= 1, block
    assert "(default: 5)" in text and "(default: 60.0)" in text  # --max-restarts, --restart-window


def test_serve_forwards_no_replica_routing_or_supervision_flags(monkeypatch):
    from services.cli.flags import forwarded_argv

    monkeypatch.setenv("PAGEDSERVE_MAX_RESTARTS", "0")
    ns = serve_parser().parse_args(["--restart-window", "10", "--max-stream-buffer", "9"])
    assert (ns.max_restarts, ns.restart_window) == (0, 10.0)
    argv = forwarded_argv("router", ns)
    assert argv[argv.index("--max-stream-buffer") + 1] == "9"
    for name in ("router", "scheduler", "worker"):
        flags = set(forwarded_argv(name, ns))
        assert not flags & {*REPLICA_ROUTING_FLAGS, "--max-restarts", "--restart-window"}, name


def test_device_cuda_without_cuda_is_a_clear_error():
    import torch

    from services.worker.device import resolve_device

    if torch.cuda.is_available():
        assert resolve_device("cuda").type == "cuda"
        return
    with pytest.raises(ValueError, match="--device cuda: torch sees no CUDA device"):
        resolve_device("cuda")


def test_serve_passes_the_pooling_flags_to_the_worker(monkeypatch):
    """--runner on the command line, --pooler-config from its environment variable: both go
    to the worker (which alone loads the model and pools), neither elsewhere."""
    from services.cli.flags import forwarded_argv

    monkeypatch.setenv("PAGEDSERVE_POOLER_CONFIG", '{"pooling_type": "MEAN"}')
    ns = serve_parser().parse_args(["--runner", "pooling"])
    argv = forwarded_argv("worker", ns)
    assert argv[argv.index("--runner") + 1] == "pooling"
    assert argv[argv.index("--pooler-config") + 1] == '{"pooling_type": "MEAN"}'
    for name in ("scheduler", "router"):
        assert not {"--runner", "--pooler-config"} & set(forwarded_argv(name, ns))


def test_serve_forwards_the_lora_flags(monkeypatch):
    from services.cli.flags import forwarded_argv

    monkeypatch.setenv("PAGEDSERVE_ALLOW_RUNTIME_LORA_UPDATING", "true")
    ns = serve_parser().parse_args([
        "--enable-lora", "--lora-modules", "sql=/a/sql", '{"name":"b","path":"/a/b"}',
        "--max-loras", "3", "--max-lora-rank", "32"])
    router = forwarded_argv("router", ns)
    i = router.index("--lora-modules")
    assert router[i + 1:i + 3] == ["sql=/a/sql", "b=/a/b"]  # (the JSON entry, no base)
    assert "--enable-lora" in router and "--allow-runtime-lora-updating" in router
    assert router[router.index("--max-lora-rank") + 1] == "32"
    scheduler = forwarded_argv("scheduler", ns)
    assert scheduler[scheduler.index("--max-loras") + 1] == "3"


def test_serve_passes_the_kv_events_config_to_the_scheduler_only():
    from services.cli.flags import forwarded_argv
    from services.scheduler.kv_events_config import KVEventsConfig

    text = '{"enable_kv_cache_events": true, "publisher": "null", "buffer_steps": 7}'
    ns = serve_parser().parse_args(["--kv-events-config", text])
    scheduler = forwarded_argv("scheduler", ns)
    value = scheduler[scheduler.index("--kv-events-config") + 1]
    assert KVEventsConfig.parse(value) == KVEventsConfig.parse(text)
    for name in ("worker", "router"):
        assert "--kv-events-config" not in forwarded_argv(name, ns)
