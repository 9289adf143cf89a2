"""Package list for setuptools: `api/`, `operator/` and `trainer/` are the sources of
`crucible.api`, `crucible.operator` and `crucible.trainer`.

Why a setup.py: pyproject's automatic discovery names packages after their folders, and the
folders cannot be named `crucible/operator` without a `crucible/` tree at the root. `operator/`
deliberately has no `__init__.py` (a top-level `operator` package would shadow the standard
library's `operator` module, which torch imports), so `crucible.operator` is a namespace package
and must be listed by hand, as must every subpackage below it.
"""

import os

from setuptools import find_namespace_packages, setup

# A folder that is absent is skipped: the operator image is built from `api/` and `operator/`
# only, with no trainer code in its build context.
SOURCES = {name: folder for name, folder in {"crucible.api": "api", "crucible.operator": "operator",
                                             "crucible.trainer": "trainer"}.items()
           if os.path.isdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), folder))}


def packages() -> list[str]:
    found = []
    for name, folder in SOURCES.items():
        found.append(name)
        found += [f"{name}.{sub}" for sub in find_namespace_packages(folder) if "__pycache__" not in sub]
    return found


setup(packages=packages(), package_dir=SOURCES, include_package_data=True)
