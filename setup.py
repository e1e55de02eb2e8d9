"""Package layout of the k3rl wheel (the metadata and dependencies are in pyproject.toml).

The code packages (agentenv, rl, model, kernels) are found as usual. The top-level folders `conf/` (Hydra
config groups, AgentENV settings) and `sandbox_images/` (image recipes) stay where they are in the
repository and ship in the wheel as the data-only packages `k3rl_resources.conf` and
`k3rl_resources.sandbox_images` (each sub-folder a package of its own, so that setuptools copies every
file); `agentenv.paths.resource_dir` finds them in a checkout, an editable install and a wheel alike.
"""

from pathlib import Path

from setuptools import find_packages, setup

RESOURCES = {"k3rl_resources.conf": "conf", "k3rl_resources.sandbox_images": "sandbox_images"}


def resource_packages() -> dict[str, str]:
    """Package name -> folder, for each resource folder and every sub-folder below it."""
    packages = {}
    for name, folder in RESOURCES.items():
        for d in [Path(folder), *sorted(p for p in Path(folder).rglob("*") if p.is_dir())]:
            if "__pycache__" not in d.parts:
                packages[".".join([name, *d.relative_to(folder).parts])] = d.as_posix()
    return packages


RESOURCE_PACKAGES = resource_packages()

setup(
    packages=[*find_packages(include=["agentenv*", "rl*", "model*", "kernels*"]), *RESOURCE_PACKAGES],
    package_dir=RESOURCE_PACKAGES,
    package_data={
        "": ["*.yaml", "Dockerfile", "*.sh", "*.txt"],  # data files inside the code packages
        **{name: ["*"] for name in RESOURCE_PACKAGES},
    },
    exclude_package_data={name: ["*.pyc"] for name in RESOURCE_PACKAGES},
)
