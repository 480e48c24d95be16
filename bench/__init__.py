"""moorline's side-by-side broker benchmark (``python -m bench`` from the repository root).

Everything here runs on loopback only, starts each broker fresh in its own temporary directory and stops it
again; see bench/README.md for what is measured and how.
"""
