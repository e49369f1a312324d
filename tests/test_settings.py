"""The settings table (metrale/settings.py) is the one place a default is written: the CLI's, LLM's, the engine
core's, the scheduler's, the worker's and the frontend's defaults are all the table's."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys

import click
import msgspec
import pytest
from click.testing import CliRunner

from metrale import settings
from metrale.cli import main
from metrale.config import EngineArgs, ServeConfig
from metrale.engine_core.engine import EngineOptions
from metrale.engine_core.hang_watch import HangWatch
from metrale.engine_core.scheduler import SchedulerConfig
from metrale.frontend.server import FrontendConfig
from metrale.llm import LLM
from metrale.settings import DEFAULTS, SETTINGS

# A view's field of a setting's name that holds something else: the model's length as resolved, not the cap.
NOT_THE_SETTING = {("scheduler", "max_model_len")}


def view_defaults() -> dict[str, dict[str, object]]:
    """Each process view's fields (or keywords) and their defaults (inspect.Parameter.empty: none)."""
    from metrale.gpu_worker.model_runner import ModelRunner

    def of_dataclass(cls) -> dict[str, object]:
        return {f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
                for f in dataclasses.fields(cls)}

    runner = inspect.signature(ModelRunner.__init__).parameters
    return {
        "frontend": of_dataclass(FrontendConfig),
        "engine_core": of_dataclass(EngineOptions),
        "scheduler": of_dataclass(SchedulerConfig),
        "runner": {name: p.default for name, p in runner.items() if name != "self"},
    }


def mismatches(view: str, defaults: dict[str, object]) -> list[str]:
    """What a view gets wrong against the table: a field of a setting's name the table does not route there, a
    default that is not the table's, a setting routed there that the view lacks."""
    wrong = []
    for name, default in defaults.items():
        s = settings.BY_NAME.get(name)
        if s is None or (view, name) in NOT_THE_SETTING:
            continue
        if view not in s.reaches:
            wrong.append(f"{view}.{name}: the table does not say it reaches {view}")
        elif default is not inspect.Parameter.empty and default != s.default:
            wrong.append(f"{view}.{name} defaults to {default!r}, the table to {s.default!r}")
    wrong += [f"{view} has no {s.name}" for s in SETTINGS if view in s.reaches and s.name not in defaults]
    return wrong


def test_every_view_defaults_to_the_table():
    views = view_defaults()
    assert [w for view, defaults in views.items() for w in mismatches(view, defaults)] == []
    assert {v.split(":")[0] for s in SETTINGS for v in s.reaches} <= set(settings.VIEWS)
    assert HangWatch().floor_s == DEFAULTS.worker_hang_timeout_s
    assert FrontendConfig("m", "a", "b").log_requests is not DEFAULTS.disable_log_requests


def test_a_default_written_differently_in_a_view_is_caught():
    @dataclasses.dataclass
    class Drifted:
        max_num_seqs: int = 256  # what SchedulerConfig said before the table
        max_waiting: int = DEFAULTS.max_waiting

    assert mismatches("scheduler", view_defaults()["scheduler"]) == []
    found = mismatches("scheduler", {f.name: f.default for f in dataclasses.fields(Drifted)})
    assert any("scheduler.max_num_seqs defaults to 256" in w for w in found), found
    assert "scheduler has no preemption_mode" in found


def test_engine_args_and_serve_config_are_the_tables_fields():
    for struct, scope in ((EngineArgs, "engine"), (ServeConfig, "serve")):
        fields = {f.name: f for f in msgspec.structs.fields(struct)}
        table = settings.of_scope(scope)
        assert [s.name for s in table] == [n for n in fields if n not in ("engine", "run_dir")]
        for s in table:
            f = fields[s.name]
            default = f.default_factory() if f.default is msgspec.NODEFAULT else f.default
            assert f.type == s.type and default == s.default, s.name
    assert ServeConfig().engine == EngineArgs()


def test_llm_keywords_default_to_the_table():
    params = inspect.signature(LLM.__init__).parameters
    assert params["dtype"].default == DEFAULTS.dtype
    assert params["generation_config"].default == DEFAULTS.generation_config
    # Every other keyword goes to EngineArgs, whose defaults are the table's (above).
    assert params["kwargs"].kind is inspect.Parameter.VAR_KEYWORD


def test_llm_runs_with_the_tables_defaults(tiny_model_dir):
    with LLM(str(tiny_model_dir("llama")), show_progress=False) as llm:
        assert llm.args == EngineArgs(model=str(tiny_model_dir("llama")), show_progress=False)
        options = llm.engine.options
        burst = DEFAULTS.decode_burst if not llm.device.threaded else 1  # a threaded device needs no bursts
        assert (options.max_num_seqs, options.max_num_batched_tokens, options.max_waiting, options.decode_burst) == \
            (DEFAULTS.max_num_seqs, DEFAULTS.max_num_batched_tokens, DEFAULTS.max_waiting, burst)
        assert llm.engine.scheduler.config.max_num_seqs == DEFAULTS.max_num_seqs
        assert llm.runner.max_num_seqs == DEFAULTS.max_num_seqs and llm.runner.block_size == DEFAULTS.block_size


def test_engine_options_take_every_shared_setting_from_the_args():
    changed = {"max_num_seqs": 5, "max_num_batched_tokens": 99, "max_waiting": 7, "enable_prefix_caching": False,
               "pipeline": False, "seed": 3, "preemption_mode": "swap", "decode_burst": 2, "speculative": "ngram",
               "num_speculative_tokens": 4, "speculative_disable_by_batch_size": 9, "lora_modules": ["a=/x"],
               "max_logprobs": 7}
    assert set(changed) == {s.name for s in settings.of_scope("engine") if "engine_core" in s.reaches}
    options = EngineOptions.from_args(EngineArgs(**changed))
    assert {k: getattr(options, k) for k in changed} == changed


def serve_params() -> dict[str, click.Option]:
    return {p.name: p for p in main.commands["serve"].params if isinstance(p, click.Option)}


def test_every_flag_is_a_serve_option_with_the_tables_default_and_help():
    params = serve_params()
    assert list(params) == [s.name for s in SETTINGS if s.flag]
    for s in SETTINGS:
        if s.flag is None:
            continue
        p = params[s.name]
        assert p.opts == [s.flag, *s.aliases] and p.help == s.help, s.name
        default = p.to_info_dict()["default"]
        if s.is_switch:
            assert p.is_flag and default is False, s.name
        elif not s.multiple:
            assert default == s.default, f"{s.flag}: {default!r} is not the table's {s.default!r}"


@pytest.fixture
def captured(monkeypatch):
    """`metrale serve ARGS` up to the supervisor: the ServeConfig it would start."""
    import metrale.supervisor

    seen = []

    def supervisor(config):
        seen.append(config)
        raise metrale.supervisor.StartupError("caught")

    monkeypatch.setattr(metrale.supervisor, "Supervisor", supervisor)
    monkeypatch.delenv("METRALE_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)

    def serve(*args: str) -> ServeConfig:
        out = CliRunner().invoke(main, ["serve", *args])
        assert out.exit_code == 2 and "caught" in out.output, out.output
        return seen.pop()

    return serve


def test_serve_without_flags_runs_the_tables_defaults(captured):
    assert captured() == ServeConfig()


def test_each_flag_reaches_its_field(captured):
    config = captured("--no-prefix-caching", "--no-pipeline", "--enforce-eager", "--kv-cache-memory", "2e9",
                      "--swap-space", "2.5", "-tp", "2", "--served-model-name", "a", "--served-model-name", "b",
                      "--api-key", "k", "--max-frame-bytes", "4096", "--shutdown-timeout", "3", "--max-num-seqs", "9",
                      "--disable-log-requests", "tiny")
    e = config.engine
    assert (e.enable_prefix_caching, e.pipeline, e.enforce_eager) == (False, False, True)
    assert e.kv_cache_memory == 2_000_000_000 and isinstance(e.kv_cache_memory, int)
    assert (e.swap_space_gb, e.tensor_parallel_size, e.max_num_seqs, e.model) == (2.5, 2, 9, "tiny")
    assert config.served_model_names == ["a", "b"] and config.api_key == "k"
    assert (config.max_frame_bytes, config.shutdown_timeout_s, config.disable_log_requests) == (4096, 3.0, True)


def test_lora_modules_take_vllm_s_list_after_one_flag_and_leave_the_model_alone(captured, tmp_path):
    from test_lora_layers import _write_adapter

    x, y, z = (str(_write_adapter(tmp_path / name)) for name in "xyz")
    config = captured("--enable-lora", "--max-loras", "3", "--lora-modules", f"a={x}", f"b={y}", "tiny",
                      "--lora-modules", f'{{"name": "c", "path": "{z}"}}')
    assert config.engine.lora_modules == [f"a={x}", f"b={y}", f'{{"name": "c", "path": "{z}"}}']
    assert config.engine.model == "tiny"


def test_the_table_imports_neither_torch_nor_click():
    code = ("import sys\nimport metrale.settings, metrale.config, metrale.engine_core.engine\n"
            "assert 'torch' not in sys.modules and 'click' not in sys.modules, 'torch or click imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_engine_args_refuse_what_the_tables_choices_and_ranges_refuse():
    for s in settings.of_scope("engine"):
        wrong = ["not-a-choice"] if s.choices else []
        wrong += [s.min - 1] if s.min is not None else []
        wrong += [s.max + 1] if s.max is not None else []
        for value in wrong:
            with pytest.raises(ValueError, match=f"^{s.name} must be"):
                EngineArgs(**{s.name: value}).validate()
    EngineArgs().validate()
