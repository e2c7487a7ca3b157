"""Small runnable clients that show how to call the service."""
