// TEMPORARY (http-layer engineer): runs /work/main/tests/*.rs while the kvgate bin does not build.
#[path = "../../tests/api.rs"]
mod api;
#[path = "../../tests/admission.rs"]
mod admission;
#[path = "../../tests/lifecycle.rs"]
mod lifecycle;
#[path = "../../tests/burst.rs"]
mod burst;
