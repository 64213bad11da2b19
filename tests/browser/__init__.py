"""The browser tests: a package, so that the fixtures of its conftest shared by every module (one served app, one
Chromium) are closed when its last test ends, before any later test starts a Playwright of its own."""
