import definitely_not_a_module  # noqa: F401
