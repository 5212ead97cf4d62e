"""Scheduling: the request queue policies, the scheduler, and the record of what one step does."""
