"""The contract constants every side of a call agrees on: metadata header names, health service
names, error reasons, and the one name rule for models, versions and tenants. No process code."""
