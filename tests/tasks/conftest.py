from task_fixtures import make_task, sandbox_config, task_home  # noqa: F401
