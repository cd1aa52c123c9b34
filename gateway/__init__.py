"""The public gateway: auth, limits, window precheck, lane dispatch, request log (docs/gateway.md)."""
