"""Which packages the distribution holds and where their files lie; everything else is in
pyproject.toml.

The single-device references are the repository's top-level reference/ folder (the layout the
project was specified with) and install as `ringcheck.reference`: nothing goes into
site-packages under the generic top-level name `reference`, which a user's own reference/
package would shadow (`python -m pytest` puts the user's directory first on sys.path). Only
setup.py can say this and still find the packages as they come: pyproject's `packages.find`
names a package after its folder, so the renamed one would have to join a fixed list of them
all. A checkout that is not installed (PYTHONPATH=<the checkout>) finds the same name through
`ringcheck._ReferenceBeside`.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["ringcheck", "ringcheck.*"]),
              *(f"ringcheck.{name}" for name in find_packages(include=["reference", "reference.*"]))],
    package_dir={"ringcheck.reference": "reference"},
)
