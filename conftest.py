"""Root pytest configuration: options and fixtures shared by the suites."""

# ---- Hypothesis profiles for the property suites (suites/test_properties*.py) --------------
# `pytest --profile {ci,nightly,deep}` picks the example count per property and the size
# bounds of the drawn cases (ringcheck.strategies.PROFILES); `ci` is the default. Under
# torchrun (RANK and WORLD_SIZE set) the derandomized, database-free variant of the profile is
# loaded, so every rank draws the same examples in the same order. To merge with other
# sections: call `_add_profile_option(parser)` from pytest_addoption,
# `_load_hypothesis_profile(config)` from pytest_configure and return `_profile_header(config)`
# from pytest_report_header.

import os

import pytest

PROFILE_NAMES = ("ci", "nightly", "deep")


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _register_hypothesis_profiles() -> None:
    from hypothesis import settings

    from ringcheck.strategies import PROFILES

    for name, profile in PROFILES.items():
        settings.register_profile(name, profile.settings())
        settings.register_profile(f"{name}-torchrun", profile.settings(torchrun=True))


def _add_profile_option(parser) -> None:
    parser.addoption("--profile", choices=PROFILE_NAMES, default="ci",
                     help="depth of the property-based search: ci (default, minutes on 2 CPU "
                          "cores), nightly or deep (more examples, larger shapes)")


def _load_hypothesis_profile(config) -> None:
    from hypothesis import settings

    _register_hypothesis_profiles()
    name = config.getoption("--profile")
    settings.load_profile(f"{name}-torchrun" if _under_torchrun() else name)


def pytest_addoption(parser):
    _add_profile_option(parser)


def _profile_header(config) -> str:
    from hypothesis import settings

    return f"ringcheck search profile: {settings.get_current_profile_name()} (--profile {{ci,nightly,deep}})"


def pytest_configure(config):
    _load_hypothesis_profile(config)


def pytest_report_header(config):
    return _profile_header(config)


@pytest.fixture(scope="session")
def search_profile(pytestconfig):
    """The `ringcheck.strategies.Profile` selected with --profile (its size bounds)."""
    from ringcheck.strategies import PROFILES

    return PROFILES[pytestconfig.getoption("--profile")]

# ---- end of the Hypothesis profiles section -------------------------------------------------
