//! The states of the domain as enums with their wire names: a node in the roster, an enrolled
//! node, a token, an evidence record and one file of it. The same names are stored in the
//! database and printed by the CLI, so each is spelled once, here.

/// A stored or received name that is none of an enum's states.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownState {
    /// What the name should have been, with its article ("a node state").
    pub kind: &'static str,
    pub given: String,
}

impl std::fmt::Display for UnknownState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?} is not {}", self.given, self.kind)
    }
}

impl std::error::Error for UnknownState {}

/// An enum whose every variant has one name, for serde, `Display` and `FromStr` alike. A name is
/// taken as a token tree, not a `literal` fragment: utoipa's derive does not read a rename out of
/// the invisible group a `literal` fragment becomes.
macro_rules! states {
    ($(#[$doc:meta])* $name:ident, $kind:literal { $($(#[$vdoc:meta])* $variant:ident = $text:tt),+ $(,)? }) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, ::serde::Serialize, ::serde::Deserialize)]
        #[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
        pub enum $name {
            $($(#[$vdoc])* #[serde(rename = $text)] $variant),+
        }

        impl $name {
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text),+
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.pad(self.as_str())
            }
        }

        impl std::str::FromStr for $name {
            type Err = $crate::state::UnknownState;

            fn from_str(s: &str) -> Result<Self, $crate::state::UnknownState> {
                match s {
                    $($text => Ok($name::$variant),)+
                    _ => Err($crate::state::UnknownState { kind: $kind, given: s.to_string() }),
                }
            }
        }
    };
}

states! {
    /// The state of an enrolled node, as stored.
    EnrolledState, "a node state" {
        /// Enrolled with a token that needs approval; receives no bundle until approved.
        Pending = "pending",
        Active = "active",
        /// Refused on its next request; its peers drop it.
        Revoked = "revoked",
    }
}

states! {
    /// A node as the roster shows it: declared, enrolled, or both.
    NodeState, "a node state" {
        /// Declared, not enrolled yet.
        Declared = "declared",
        /// Declared with its own public key: managed outside trellis, never enrols.
        External = "external",
        Pending = "pending",
        Active = "active",
        /// Revoked, while a node that held its key has not applied a bundle without it (ADR
        /// 0022): its certificate is refused, but a peer may still accept its packets.
        Revoking = "revoking",
        /// Revoked, and every node that held its key applied a bundle without it.
        Revoked = "revoked",
        /// Enrolled, no longer declared.
        Removed = "removed",
        /// A pool's member the sweep removed, while a node that held its key has not applied a
        /// bundle without it (ADR 0022).
        Removing = "removing",
    }
}

impl From<EnrolledState> for NodeState {
    fn from(s: EnrolledState) -> Self {
        match s {
            EnrolledState::Pending => NodeState::Pending,
            EnrolledState::Active => NodeState::Active,
            EnrolledState::Revoked => NodeState::Revoked,
        }
    }
}

states! {
    /// A node as the live picture shows it: its roster state, with an active node that has not
    /// applied its desired version shown stale, and one whose last apply failed shown failing.
    Shown, "a shown state" {
        Active = "active",
        Pending = "pending",
        Revoking = "revoking",
        Revoked = "revoked",
        Stale = "stale",
        Failing = "failing",
        Declared = "declared",
        External = "external",
        Removed = "removed",
    }
}

states! {
    /// What a node's peers are to drop it for (ADR 0022): it was revoked, or it was a pool's
    /// member the sweep removed.
    #[derive(Default)]
    Withdrawal, "a withdrawal" {
        #[default]
        Revocation = "revocation",
        Removal = "removal",
        /// Routes or relaying taken from a node still in the mesh (a router removed from a
        /// route, a hub no longer a hub): followed until every node that sent them through it
        /// applied a bundle that does not.
        Routes = "routes",
    }
}

states! {
    /// An enrolment token.
    TokenState, "a token state" {
        Valid = "valid",
        Used = "used",
        Expired = "expired",
        Revoked = "revoked",
    }
}

states! {
    /// What an agent did with one bundle.
    EvidenceResult, "an evidence result state" {
        Applied = "applied",
        Failed = "failed",
    }
}

states! {
    /// What an agent did with one file of a bundle.
    FileResult, "a file result state" {
        Written = "written",
        Unchanged = "unchanged",
        Removed = "removed",
        Failed = "failed",
    }
}

pub(crate) use states;

#[cfg(test)]
mod tests {
    use super::*;
    use serde::{Deserialize, Serialize};

    /// The wire name, the stored name and the printed name are one.
    fn round_trips<T>(all: &[T])
    where
        T: Copy + std::fmt::Debug + PartialEq + std::fmt::Display + std::str::FromStr + Serialize + for<'de> Deserialize<'de>,
        T::Err: std::fmt::Debug,
    {
        for s in all {
            let text = s.to_string();
            assert_eq!(serde_json::to_string(s).unwrap(), format!("\"{text}\""));
            assert_eq!(serde_json::from_str::<T>(&format!("\"{text}\"")).unwrap(), *s);
            assert_eq!(text.parse::<T>().unwrap(), *s);
        }
    }

    #[test]
    fn every_state_has_one_name() {
        round_trips(EnrolledState::ALL);
        round_trips(NodeState::ALL);
        round_trips(Shown::ALL);
        round_trips(TokenState::ALL);
        round_trips(Withdrawal::ALL);
        round_trips(EvidenceResult::ALL);
        round_trips(FileResult::ALL);
        for s in EnrolledState::ALL {
            // A revoked node is shown `revoking` until its revocation is complete (ADR 0022).
            assert_eq!(NodeState::from(*s).as_str(), s.as_str());
        }
        assert_eq!(format!("{:<9}|", NodeState::Active), "active   |", "tables pad states like strings");
        assert_eq!("approved".parse::<EnrolledState>().unwrap_err().to_string(), "\"approved\" is not a node state");
    }
}
