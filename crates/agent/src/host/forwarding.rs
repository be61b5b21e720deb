//! IP forwarding on a real host, through the kernel's `/proc/sys` knobs.

use anyhow::{Context, Result};

use super::traits::Forwarding;

/// Forwarding through the kernel's `/proc/sys` knobs.
pub struct ProcSys;

const FORWARDING_KNOBS: [&str; 2] = ["/proc/sys/net/ipv4/ip_forward", "/proc/sys/net/ipv6/conf/all/forwarding"];

impl Forwarding for ProcSys {
    fn enabled(&self) -> bool {
        FORWARDING_KNOBS.iter().all(|k| std::fs::read_to_string(k).is_ok_and(|v| v.trim() == "1"))
    }

    fn enable(&mut self) -> Result<()> {
        for knob in FORWARDING_KNOBS {
            std::fs::write(knob, "1").with_context(|| format!("cannot enable forwarding ({knob})"))?;
        }
        Ok(())
    }
}
