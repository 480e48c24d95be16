"""The operators' surface: the HTTP API and console, $SYS topics, the admin CLIs."""
