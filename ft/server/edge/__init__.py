"""The HTTP edge: what every request passes before and after a route (auth, body limits, the
h11 protocol hardening, per-write send deadlines, tracing, and the HTTP error shapes)."""
