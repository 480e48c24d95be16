"""Test-only instruments and deliberately broken builds, injected by a test harness.

Nothing here is reachable from ``moorline run``: the production entry point never reads a fault
switch from its environment or its configuration. Harnesses start a node through
``python -m moorline.testing.faulty_node --faults JSON run ...`` (real processes) or pass a
``Faults`` object to ``Node`` / ``serve`` directly (in-process tests).
"""
