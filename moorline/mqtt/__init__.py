"""Pure, sans-IO MQTT 3.1.1 / 5.0: packets, codec, per-connection protocol state, topics."""
