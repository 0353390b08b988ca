"""The API process: the app factory, middleware, the event stream, Prometheus, health, and the sweeper loop."""
