//! `--device`: which backend runs the model, decided once at start from what the host offers
//! ([`DeviceProbe`]). `auto` takes GPU 0 when the driver, a GPU and the NVRTC and cuBLAS
//! libraries are all usable, else the CPU, and says why; an explicit `cuda[:N]` request that
//! cannot be served fails with one line naming what is missing.

use std::fmt;
use std::str::FromStr;

use kvgate_kernels::cuda::probe::DeviceProbe;

/// What the operator asked for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeviceRequest {
    /// A usable NVIDIA GPU (`cuda:0`) when there is one and a backend for it, else the CPU.
    #[default]
    Auto,
    Cpu,
    /// GPU number N as the driver counts them (`cuda` is `cuda:0`).
    Cuda(usize),
}

const ACCEPTED: &str = "expected auto, cpu, cuda or cuda:N (N a GPU number, e.g. cuda:0)";

impl FromStr for DeviceRequest {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "auto" => Ok(DeviceRequest::Auto),
            "cpu" => Ok(DeviceRequest::Cpu),
            "cuda" => Ok(DeviceRequest::Cuda(0)),
            other => other
                .strip_prefix("cuda:")
                // Digits only: `usize::from_str` would also take a leading `+`.
                .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|n| n.parse().ok())
                .map(DeviceRequest::Cuda)
                .ok_or_else(|| format!("{ACCEPTED}, got `{other}`")),
        }
    }
}

impl fmt::Display for DeviceRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceRequest::Auto => f.write_str("auto"),
            DeviceRequest::Cpu => f.write_str("cpu"),
            DeviceRequest::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// The device the runtime will use and why, for the start-up log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceChoice {
    pub device: Device,
    pub reason: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    Cpu,
    /// The GPU of this ordinal, through the CUDA backend.
    Cuda(usize),
}

impl fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.device {
            Device::Cpu => write!(f, "device: cpu ({})", self.reason),
            Device::Cuda(n) => write!(f, "device: cuda:{n} ({})", self.reason),
        }
    }
}

/// Why a `--device cuda[:N]` request cannot be served.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    #[error("--device {request}: {cause}; use --device cpu or auto")]
    Unavailable {
        request: DeviceRequest,
        cause: String,
    },
}

/// Decides the device for `request`; `probe` runs only when a GPU is in question, so `cpu`
/// never loads a CUDA library.
pub fn select_device(
    request: DeviceRequest,
    probe: impl FnOnce() -> DeviceProbe,
) -> Result<DeviceChoice, DeviceError> {
    let ordinal = match request {
        DeviceRequest::Cpu => {
            return Ok(DeviceChoice {
                device: Device::Cpu,
                reason: "--device cpu".into(),
            });
        }
        DeviceRequest::Auto => 0,
        DeviceRequest::Cuda(n) => n,
    };
    let probe = probe();
    let gpu = probe.usable_gpu(ordinal);
    match (request, gpu) {
        (_, Ok(gpu)) => Ok(DeviceChoice {
            device: Device::Cuda(ordinal),
            reason: format!("{gpu}; driver, NVRTC and cuBLAS usable"),
        }),
        (DeviceRequest::Auto, Err(cause)) => Ok(DeviceChoice {
            device: Device::Cpu,
            reason: cause.to_string(),
        }),
        (_, Err(cause)) => Err(DeviceError::Unavailable {
            request,
            cause: cause.to_string(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use kvgate_kernels::cuda::probe::{Driver, FoundLibrary, Gpu, ProbeError};

    use super::*;

    #[test]
    fn parses_the_accepted_forms_and_names_them_for_anything_else() {
        assert_eq!("auto".parse(), Ok(DeviceRequest::Auto));
        assert_eq!("cpu".parse(), Ok(DeviceRequest::Cpu));
        assert_eq!("cuda".parse(), Ok(DeviceRequest::Cuda(0)));
        assert_eq!("cuda:0".parse(), Ok(DeviceRequest::Cuda(0)));
        assert_eq!("cuda:3".parse(), Ok(DeviceRequest::Cuda(3)));
        for bad in [
            "gpu", "cuda:x", "cuda:", "cuda:+1", "cuda:-1", "CPU", "cuda:1:2", "",
        ] {
            let err = bad.parse::<DeviceRequest>().expect_err(bad);
            assert_eq!(
                err,
                format!(
                    "expected auto, cpu, cuda or cuda:N (N a GPU number, e.g. cuda:0), got `{bad}`"
                )
            );
        }
        for request in [
            DeviceRequest::Auto,
            DeviceRequest::Cpu,
            DeviceRequest::Cuda(2),
        ] {
            assert_eq!(request.to_string().parse(), Ok(request), "round trip");
        }
    }

    fn absent() -> DeviceProbe {
        DeviceProbe::with_candidates(
            &[PathBuf::from("/nonexistent/libcuda.so.1")],
            &[PathBuf::from("/nonexistent/libnvrtc.so.12")],
            &[PathBuf::from("/nonexistent/libcublas.so.12")],
        )
    }

    fn complete() -> DeviceProbe {
        let lib = |p: &str| {
            Ok(FoundLibrary {
                path: p.into(),
                version: None,
            })
        };
        DeviceProbe {
            driver: Ok(Driver {
                path: "libcuda.so.1".into(),
                cuda_version: (13, 0),
                gpus: vec![Gpu {
                    ordinal: 0,
                    name: "NVIDIA H200".into(),
                    compute_capability: (9, 0),
                }],
            }),
            nvrtc: lib("libnvrtc.so.13"),
            cublas: lib("libcublas.so.13"),
        }
    }

    #[test]
    fn cpu_never_probes() {
        let choice = select_device(DeviceRequest::Cpu, || panic!("probed for --device cpu"));
        assert_eq!(choice.unwrap().to_string(), "device: cpu (--device cpu)");
    }

    #[test]
    fn auto_falls_back_to_the_cpu_and_says_what_is_missing() {
        let choice = select_device(DeviceRequest::Auto, absent).unwrap();
        assert_eq!(choice.device, Device::Cpu);
        let line = choice.to_string();
        assert!(
            line.starts_with("device: cpu (no NVIDIA driver (/nonexistent/libcuda.so.1"),
            "{line}"
        );
        let with_gpu = select_device(DeviceRequest::Auto, complete).unwrap();
        assert_eq!(with_gpu.device, Device::Cuda(0), "a usable GPU is chosen");
        assert_eq!(
            with_gpu.to_string(),
            "device: cuda:0 (cuda:0 NVIDIA H200 (sm_90); driver, NVRTC and cuBLAS usable)"
        );
    }

    #[test]
    fn cuda_is_chosen_when_usable_and_otherwise_fails_with_the_missing_piece() {
        let err = select_device(DeviceRequest::Cuda(0), absent).unwrap_err();
        let line = err.to_string();
        assert!(
            line.starts_with("--device cuda:0: no NVIDIA driver ("),
            "{line}"
        );
        assert!(line.ends_with("; use --device cpu or auto"), "{line}");
        assert!(!line.contains('\n'), "{line}");

        let choice = select_device(DeviceRequest::Cuda(0), complete).unwrap();
        assert_eq!(choice.device, Device::Cuda(0));

        let err = select_device(DeviceRequest::Cuda(1), complete).unwrap_err();
        assert_eq!(
            err,
            DeviceError::Unavailable {
                request: DeviceRequest::Cuda(1),
                cause: ProbeError::NoSuchOrdinal {
                    ordinal: 1,
                    count: 1
                }
                .to_string(),
            }
        );
    }
}
