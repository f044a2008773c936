"""Tests of gateway/admission: the scheduler, rate limits, the prompt window."""
