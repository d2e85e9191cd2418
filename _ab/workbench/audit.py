"""`python -m workbench.audit RUN_DIR [-o PAGE]`: a run's audit page (workbench/widgets/audit.py)."""

from .widgets.audit import main

if __name__ == "__main__":
    main()
