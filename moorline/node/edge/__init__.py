"""The client edge: MQTT connections over TCP, TLS and WebSocket, listeners and authentication."""
