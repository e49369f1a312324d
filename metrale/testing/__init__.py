"""What tests and benchmarks drive the engine with, never imported by the product: FakeDevice (a toy model behind
the Device protocol, with fault injection) and FakeClock. tests/test_state_owners.py fails when a product module
imports this package."""
