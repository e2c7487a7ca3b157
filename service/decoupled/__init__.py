"""Decoupled models: 0..N responses per request (config `decoupled`)."""
