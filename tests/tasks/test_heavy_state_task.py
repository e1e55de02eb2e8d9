"""KVLookup, the task whose sandbox holds heavy state: a service with the data set loaded in memory.

Real sandboxes (Docker + CRIU), with a small data set (8 MiB) so that generating and loading it takes
about a second: gymnasium compliance, determinism, that winning needs the service's answers, and that
the loaded service survives pause/resume, fork and pool warm starts (forks of one loaded template).
"""

import uuid

import pytest
from gymnasium.utils.env_checker import check_env

from agentenv.factory import PooledSandboxes
from agentenv.pool import SandboxPool
from agentenv.tasks.kv_lookup import KVLookup
from rl.sft.experts import expert_for

pytestmark = pytest.mark.docker

ENV_ID = "agentenv/KVLookup-v0"
MIB = 8


def _play(env, seed, policy):
    """One episode; ``policy(observation, history)`` gives each action. Returns (success, observations)."""
    obs, _ = env.reset(seed=seed)
    observations, history = [obs], []
    while True:
        action = policy(obs, history)
        obs, reward, terminated, truncated, info = env.step(action)
        history.append((action, obs, reward))
        observations.append(obs)
        if terminated or truncated:
            return info["success"], observations, [r for _, _, r in history]


def _continue(env, actions):
    """Steps ``actions`` until the episode ends: [(observation, reward, terminated), ...]."""
    out = []
    for action in actions:
        obs, reward, terminated, truncated, _ = env.step(action)
        out.append((obs, reward, terminated))
        if terminated or truncated:
            break
    return out


def test_kv_lookup_passes_gymnasiums_env_checker_and_serves_its_table_from_memory(make_task):
    env = make_task(ENV_ID, data_mib=MIB)
    check_env(env, skip_render_check=True)
    env.reset(seed=0)
    assert env.service_boot and env.num_records == MIB * 2**20 // 16
    assert env.sandbox.stats().rss_bytes >= MIB * 2**20  # the table is resident in the sandbox


def test_kv_lookup_is_deterministic_given_the_seed_and_depends_on_the_data(make_task):
    a, b = make_task(ENV_ID, data_mib=MIB), make_task(ENV_ID, data_mib=MIB)
    other_data = make_task(ENV_ID, data_mib=MIB, data_seed=1)

    def fixed(obs, history):
        return "352"[len(history)]

    plays = {name: [_play(env, s, fixed)[1:] for s in range(6)] for name, env in
             (("a", a), ("b", b), ("other", other_data))}
    assert plays["a"] == plays["b"]
    assert a.service_boot != b.service_boot  # two separately loaded services, the same answers
    assert plays["a"] != plays["other"]  # the answers come from the data set


def test_kv_lookup_needs_the_services_answers(make_task):
    """Ignoring the answers (a fixed list of guesses) wins max_turns/num_values = half the games at
    most; the scripted expert's binary search on the answers wins all of them."""
    env = make_task(ENV_ID, data_mib=MIB)
    assert env.max_turns / env.num_values == 0.5
    seeds = range(96)

    def blind(obs, history):
        return str(len(history))  # 0, 1, 2 whatever the answers

    def expert(obs, history):
        if not history:
            expert.player = expert_for(ENV_ID)
            expert.player.start(obs)
        return expert.player.act(obs)

    blind_wins = sum(_play(env, s, blind)[0] for s in seeds) / len(seeds)
    expert_wins = sum(_play(env, s, expert)[0] for s in seeds) / len(seeds)
    assert 0.35 <= blind_wins <= 0.6  # expectation 0.5
    assert expert_wins == 1.0


def test_kv_lookup_rejects_bad_actions_and_kwargs_and_reports_a_dead_service(make_task):
    env = make_task(ENV_ID, data_mib=MIB, ruled_out_penalty=0.2)
    assert env.reset(seed=3)[0] == f"key {env.key}: 0-5"
    obs, reward, terminated, _, info = env.step("no digit")
    assert (obs, reward, terminated, info["valid"]) == ("invalid", -0.1, False, False)
    # the service dies (and is gone before the next request, even on a loaded host): a clear error, no hang
    env.run("pid=$(cut -d' ' -f2 /workspace/kv/status); kill $pid; "
            "for _ in $(seq 100); do kill -0 $pid 2>/dev/null || break; sleep 0.05; done")
    with pytest.raises(RuntimeError, match="the KV service is not running"):
        env.step("1")
    with pytest.raises(ValueError, match="data_mib must be an integer in 1..4096"):
        KVLookup(data_mib=0)
    with pytest.raises(ValueError, match="data_seed must be a non-negative integer"):
        KVLookup(data_seed=-1)


def test_kv_lookup_state_survives_pause_resume_and_fork(make_task):
    env, twin = make_task(ENV_ID, data_mib=MIB), make_task(ENV_ID, data_mib=MIB)
    env.reset(seed=7), twin.reset(seed=7)
    assert env.step("2")[0] == twin.step("2")[0]
    boot = env.service_boot

    env.pause()
    assert env.paused and env.sandbox.stats().rss_bytes < 8 * 2**20  # the table is on disk, not in memory
    env.resume()
    assert env.ask("info").endswith(f"boot {boot}")  # the same service process, not a reload
    assert _continue(env, ("0", "5")) == _continue(twin, ("0", "5"))

    env.reset(seed=11)
    env.step("1")
    forks = env.fork(2)
    try:
        parent = _continue(env, ("4", "0"))
        for fork in forks:  # every fork serves the parent's loaded table and goes on with its episode
            assert fork.sandbox.id != env.sandbox.id
            assert fork.ask("info") == env.ask("info")
            assert _continue(fork, ("4", "0")) == parent
    finally:
        for fork in forks:
            fork.close()


def test_kv_lookup_pool_members_are_forks_of_one_loaded_template(sandbox_config):
    """With warm starts, `install()` (generate + load) runs once per pool template: every member's
    service reports the template's boot id. A member of another data set is refused with a clear error."""
    from agentenv import SandboxConfig

    pool = SandboxPool(f"kvlookup-{uuid.uuid4().hex[:6]}", config=SandboxConfig.from_dict(sandbox_config),
                       warm_starts=True)
    envs = []

    def member(**kwargs):
        envs.append(KVLookup(data_mib=MIB, sandbox={"config": sandbox_config},
                             sandboxes=PooledSandboxes(pool), **kwargs))
        return envs[-1]

    try:
        members = [member(), member()]
        first = [m.reset(seed=5)[0] for m in members]
        assert first[0] == first[1]
        assert members[0].service_boot == members[1].service_boot
        assert members[0].sandbox.id != members[1].sandbox.id
        assert pool.metrics().templates == 1
        assert _continue(members[0], ("3", "1")) == _continue(members[1], ("3", "1"))

        stranger = member(data_seed=9)
        with pytest.raises(RuntimeError, match="holds data_seed=0 data_mib=8, this env wants data_seed=9"):
            stranger.reset(seed=5)
    finally:
        for env in envs:
            env.close()
        pool.close()
