"""The run config: typed schemas, checked up front; every bad value is one line naming key and file."""

import dataclasses
import subprocess
import sys

import pytest
from hydra.core.config_store import ConfigStore
from rl_testutil import ROOT, compose

from agentenv.errors import ConfigError as AgentEnvConfigError
from model.config import K3Config
from rl.config import AlgoConfig, ConfigError, EnvConfig, RunConfig
from rl.config.load import register_schemas


def test_default_config_loads_as_typed_objects():
    cfg = compose()
    assert isinstance(cfg, RunConfig) and isinstance(cfg.algo, AlgoConfig) and isinstance(cfg.env, EnvConfig)
    assert isinstance(cfg.model, K3Config)  # the model group's schema is the model's own config
    assert cfg.algo.name == "grpo" and cfg.env.id == "agentenv/GuessNumber-v0"
    assert isinstance(cfg.algo.optim.lr, float) and isinstance(cfg.algo.group_size, int)
    assert cfg.algo.optim.betas == [0.9, 0.99] and cfg.sft.optim.lr != cfg.algo.optim.lr
    assert cfg.model.vocab_size == cfg.tokenizer.vocab_size == 272
    assert cfg.sandbox["network"] == "none" and cfg.env.wrappers == []


def test_the_yaml_files_hold_every_value_the_schemas_only_types_and_ranges():
    """No schema field carries a value of its own: required (MISSING) or None ("not set")."""
    from omegaconf import MISSING

    from rl.config.schema import GROUP_SCHEMAS, OptimConfig, SandboxPoolConfig

    nested = {"optim": OptimConfig, "sandbox_pool": SandboxPoolConfig}  # blocks inside the groups
    for name, schema in {**GROUP_SCHEMAS, **nested}.items():
        if issubclass(schema, K3Config):  # the model's own dataclass (and model.init_from)
            continue
        for field in dataclasses.fields(schema):
            assert field.default in (MISSING, None, dataclasses.MISSING), f"{name}.{field.name}"


def test_schemas_are_registered_in_hydras_config_store():
    register_schemas()
    repo = ConfigStore.instance().repo
    assert "k3rl_schema.yaml" in repo
    assert all(f"{g}_schema.yaml" in repo[g] for g in ("model", "algo", "env", "rollout", "trainer"))


def test_one_config_error_for_the_project():
    assert ConfigError is AgentEnvConfigError and issubclass(ConfigError, ValueError)


@pytest.mark.parametrize(
    "overrides, message",
    [
        # a wrong type, an out-of-range value, an unknown key, a missing key
        (["algo.optim.lr=abc"],
         "algo.optim.lr: expected float, got 'abc' (command-line override algo.optim.lr=abc)"),
        (["algo.optim.lr=-1"],
         "algo.optim.lr: must be > 0, got -1.0 (command-line override algo.optim.lr=-1)"),
        (["+algo.lr=1e-3"], "algo.lr: unknown key 'lr' (no such setting in algo)"),  # now algo.optim.lr
        (["algo.optim.betas=[0.9]"], "algo.optim.betas: expected [beta1, beta2], got [0.9]"),
        (["sft.optim.betas=[0.9,1.0]"], "sft.optim.betas[1]: must be < 1, got 1.0"),
        (["sft.optim.warmup_steps=-1"], "sft.optim.warmup_steps: must be >= 0, got -1 (command-line"),
        (["+algo.foo=1"], "algo.foo: unknown key 'foo' (no such setting in algo)"),
        (["~algo.kl_coef"], "algo.kl_coef: missing: every option of this group must set it"),
        (["algo=ppo", "algo.lam=1.5"], "algo.lam: must be <= 1, got 1.5"),
        (["algo.group_size=1"], "algo.group_size: GRPO needs groups of at least 2 episodes"),
        (["algo.episodes_per_step=10"], "algo.episodes_per_step: 10 episodes per step cannot be split"),
        (["algo.loss_aggregation=sum"], "algo.loss_aggregation: 'sum' is not one of"),
        (["env.id=agentenv/Nope-v0"], "env.id: 'agentenv/Nope-v0' is not a registered gymnasium env"),
        (["env.group_start=clone"], "env.group_start: 'clone' is not one of ['fork', 'seed']"),
        (["env.wrappers=[nope:Wrapper]"], "env.wrappers[0]: cannot import module 'nope'"),
        (["rollout.num_workers=3"], "trainer.num_cpus: the learner (1.0) and 3 worker(s)"),
        (["model.vocab_size=200"], "model.vocab_size: 200 is smaller than the tokenizer's vocabulary"),
        (["model.hidden_size=-3"], "model.hidden_size: must be a positive integer, got -3"),
        (["sandbox.memory=lots"], "sandbox.memory: expected a size like '512m' or '1g', got 'lots'"),
        (["sandbox.hosts=[foo]"], "sandbox.hosts[0]: 'foo' is not the URL of an agentenv serve host"),
        (["sandbox.hosts=http://h:3000"], "sandbox.hosts: expected a list of agentenv serve URLs"),
        (["+rollout.sandbox_pool.overrides.idle_after_s=x"], "rollout.sandbox_pool.overrides: pool config"),
        (["trainer.stop_at_success=2"], "trainer.stop_at_success: must be <= 1, got 2.0"),
        (["tokenizer.kind=hf"], "tokenizer.path: tokenizer.kind=hf needs the path"),
        (["+trainer.learner_resources.learner=1"], "trainer.learner_resources: local Ray offers no custom"),
        (["trainer=cluster", "trainer.worker_resources.rollout=0"],
         "trainer.worker_resources: rollout: 0.0 is not a positive custom resource"),
        (["trainer=cluster", "trainer.worker_placement=pack"], "trainer.worker_placement: 'pack' is not one"),
        (["trainer.learner.world_size=3", "trainer.num_cpus=4"],
         "trainer.learner.world_size: 3 ranks cannot share the 8 groups"),
        (["trainer.learner.world_size=2", "trainer.num_cpus=3", "trainer.learner.expert_parallel=4"],
         "trainer.learner.expert_parallel: 4 does not divide trainer.learner.world_size=2"),
        (["model=k3_tiny", "model.num_experts=15", "trainer.learner.world_size=2", "trainer.num_cpus=3",
          "trainer.learner.expert_parallel=2"],
         "trainer.learner.expert_parallel: 2 ranks cannot hold equal shares of model.num_experts=15 "),
        (["trainer.learner.world_size=2"], "trainer.num_cpus: the learner (1.0 x 2 ranks) and 1 worker(s)"),
        (["stage=sft", "trainer.learner.world_size=2", "trainer.num_cpus=3"],
         "trainer.learner.world_size: 2: the SFT cold start (stage=sft) runs in one learner process"),
    ],
)
def test_bad_values_are_one_line_naming_their_key(overrides, message):
    with pytest.raises(ConfigError) as caught:
        compose(*overrides)
    text = str(caught.value)
    assert text.startswith(message) and "\n" not in text


def test_sandbox_hosts_need_the_key_and_refuse_what_only_local_sandboxes_do(monkeypatch):
    """``sandbox.hosts``: the API key must be in the driver's environment; the local pool's pausing and
    warm starts, and an env's own memory limit, would be ignored for remote sandboxes: refused."""
    from rl.rollout.runner import task_kwargs
    from rl.sandbox_hosts import worker_environment

    hosts = "sandbox.hosts=[http://10.0.0.1:3000,https://h.example:8443]"
    monkeypatch.delenv("AGENTENV_API_KEY", raising=False)
    with pytest.raises(ConfigError, match=r"^sandbox\.hosts: set \$AGENTENV_API_KEY"):
        compose(hosts)
    monkeypatch.setenv("AGENTENV_API_KEY", "k3y")
    cfg = compose(hosts)
    assert compose().sandbox["hosts"] == [] and worker_environment(compose().sandbox) == {}
    assert worker_environment(cfg.sandbox) == {"AGENTENV_API_KEY": "k3y"}
    sandbox = task_kwargs(cfg.env, cfg.sandbox)["sandbox"]
    assert sandbox["hosts"] == ["http://10.0.0.1:3000", "https://h.example:8443"]
    assert "hosts" not in sandbox["config"] and sandbox["config"]["network"] == "none"
    for extra, key in [
        ("rollout.sandbox_pool.pause_policy=always", "rollout.sandbox_pool.pause_policy"),
        ("rollout.sandbox_pool.overrides.warm_starts=true", "rollout.sandbox_pool.overrides.warm_starts"),
        ("env=kv_lookup", "env.kwargs.sandbox.memory"),
    ]:
        with pytest.raises(ConfigError, match=rf"^{key}: .*sandbox.hosts"):
            compose(hosts, extra)
    with pytest.raises(ConfigError, match=r"^sandbox\.hosts: a host is listed twice"):
        compose("sandbox.hosts=[http://h:1,http://h:1/]")


def test_the_cluster_trainer_places_actors_by_custom_resources():
    """conf/trainer/cluster.yaml: join a running cluster, the learner on a node offering ``learner``, the
    rollout workers spread over nodes offering ``rollout``; no local CPU count is checked there."""
    cfg = compose("trainer=cluster", "rollout.num_workers=8").trainer
    assert cfg.ray_address == "auto" and cfg.worker_placement == "spread"
    assert cfg.learner_resources == {"learner": 1.0} and cfg.worker_resources == {"rollout": 1.0}
    local = compose().trainer
    assert local.learner_resources == {} and local.worker_resources == {}
    assert local.worker_placement == "default"


def test_an_error_names_the_yaml_file_to_fix_when_no_override_set_the_value():
    with pytest.raises(ConfigError, match=r"^trainer\.num_cpus: .* \(conf/trainer/local\.yaml\)$"):
        compose("rollout.num_workers=3")


def test_inherited_keys_name_the_file_that_sets_them():
    from rl.config.load import Origin

    origin = Origin({"algo": "ppo", "rollout": "vllm"}, [])
    assert origin.of("algo.gamma") == "conf/algo/ppo.yaml"  # set in ppo.yaml itself
    assert origin.of("algo.clip_low") == "conf/algo/grpo.yaml"  # inherited from grpo.yaml
    assert origin.of("algo.optim.lr") == "conf/algo/ppo.yaml"  # a nested key ppo.yaml sets itself
    assert origin.of("algo.optim.betas[1]") == "conf/algo/grpo.yaml"  # one of that block it does not set
    assert origin.of("rollout.temperature") == "conf/rollout/torch.yaml"
    assert origin.of("seed") == "conf/config.yaml"


def test_vllm_rollout_composes_with_its_typed_engine_block():
    cfg = compose("rollout=vllm")
    assert cfg.rollout.engine == "vllm" and cfg.rollout.temperature == 1.0  # the rest is torch.yaml's
    assert cfg.rollout.vllm.dtype == "float32" and cfg.rollout.vllm.enable_prefix_caching is False
    assert cfg.rollout.vllm.max_model_len >= cfg.env.max_episode_tokens
    assert compose().rollout.vllm is None  # rollout=torch has no vllm block


def test_vllm_rollout_refuses_requests_longer_than_its_engine_holds():
    with pytest.raises(ConfigError, match=r"^rollout\.vllm\.max_model_len: 64 tokens cannot hold an episode"):
        compose("rollout=vllm", "rollout.vllm.max_model_len=64")
    with pytest.raises(ConfigError, match=r"^rollout\.vllm\.dtype: 'float16' is not one of"):
        compose("rollout=vllm", "rollout.vllm.dtype=float16")
    with pytest.raises(ConfigError, match=r"^rollout\.vllm\.enable_prefix_caching: vLLM 0.32 caches K3's KDA "
                       r"states only with chunked prefill .* set it to false"):
        compose("rollout=vllm", "rollout.vllm.enable_prefix_caching=true")


def test_ppo_and_rloo_compose():
    ppo = compose("algo=ppo")
    assert ppo.algo.advantage == "gae" and ppo.algo.gamma == 1.0 and ppo.algo.minibatches == 2
    assert compose("algo=rloo").algo.advantage == "rloo"


@pytest.mark.parametrize(
    "override, expected",
    [
        ("algo.optim.lr=-1", "k3rl-train: config error: algo.optim.lr: must be > 0, got -1.0"),
        ("algo.clip_low=abc", "k3rl-train: config error: algo.clip_low: expected float, got 'abc'"),
    ],
)
def test_the_cli_prints_one_line_and_no_traceback(tmp_path, override, expected):
    """`python -m rl.train <bad override>` exits 2 with the message, before Ray or any sandbox."""
    proc = subprocess.run(
        [sys.executable, "-m", "rl.train", override, f"hydra.run.dir={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().startswith(expected) and len(proc.stderr.strip().splitlines()) == 1
    assert "Traceback" not in proc.stderr and not (tmp_path / "checkpoints").exists()


def test_the_config_and_its_checks_load_without_torch():
    """Composing and checking a config (a config error, ``--cfg job``) comes back before torch, Ray or the
    model's modules are imported: in under a second, not after seconds of imports."""
    code = ("import sys; from rl.train import resolve_config; sys.path.insert(0, 'tests/rl'); "
            "from rl_testutil import compose; compose('algo=ppo', 'env=find_value'); "
            "print(sorted(m for m in ('torch', 'ray', 'model.k3') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_a_users_group_file_can_start_from_the_stored_schema(tmp_path):
    """``defaults: [algo_schema, ...]`` types a user's own algo file at composition time."""
    from hydra.errors import ConfigCompositionException
    from rl_testutil import compose_raw

    (tmp_path / "algo").mkdir()
    mine_yaml = "defaults: [algo_schema, grpo, _self_]\noptim: {lr: 2.0e-3}\n"
    (tmp_path / "algo" / "mine.yaml").write_text(mine_yaml)
    register_schemas()
    searchpath = f"hydra.searchpath=[file://{tmp_path}]"
    mine = compose("algo=mine", searchpath).algo.optim
    assert mine.lr == 2.0e-3 and mine.warmup_steps == compose().algo.optim.warmup_steps  # the rest: grpo's
    with pytest.raises(ConfigCompositionException, match="algo.optim.lr=abc"):
        compose_raw("algo=mine", searchpath, "algo.optim.lr=abc")
