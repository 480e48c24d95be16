"""moorline: a replicated MQTT broker that never loses an acknowledged message."""

__version__ = "0.1.0"
