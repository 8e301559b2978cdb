"""Shared by the ParameterServerStrategy tests: every test is bounded in time."""

import faulthandler

import pytest

#: Seconds a parameter-server test may take before the process dumps every thread's
#: stack and exits (a hang fails CI with the stacks instead of waiting forever).
TEST_BOUND_S = 180


@pytest.fixture(autouse=True)
def bounded_test():
    faulthandler.dump_traceback_later(TEST_BOUND_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()
