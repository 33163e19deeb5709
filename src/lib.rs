//! distgpt: GPT-2-family training on one device or many, llm.c style.

/// `Display` for a `clap::ValueEnum`: the name the command line takes
/// (`fsdp`, `zb-h1`), so a value prints as it is typed.
macro_rules! display_as_flag {
    ($t:ty) => {
        impl std::fmt::Display for $t {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                let value = clap::ValueEnum::to_possible_value(self);
                f.write_str(value.expect("every value has a name").get_name())
            }
        }
    };
}
pub(crate) use display_as_flag;

/// An enum whose variants each carry a name: the enum, `ALL` (every
/// variant, in order) and `name()` from one list of `Variant = "name"`.
macro_rules! named_enum {
    (
        $(#[$meta:meta])*
        $vis:vis enum $enum:ident { $($(#[$vmeta:meta])* $variant:ident = $name:literal,)* }
        $(#[$fnmeta:meta])*
        fn name
    ) => {
        $(#[$meta])*
        $vis enum $enum { $($(#[$vmeta])* $variant,)* }

        impl $enum {
            /// Every variant, in order.
            pub const ALL: [$enum; [$($name),*].len()] = [$($enum::$variant),*];

            $(#[$fnmeta])*
            pub fn name(self) -> &'static str {
                match self {
                    $($enum::$variant => $name,)*
                }
            }
        }
    };
}
pub(crate) use named_enum;

pub mod backend;
pub mod checkpoint;
pub mod comm;
pub mod compare;
pub mod data;
pub mod error;
pub mod figure;
pub mod metrics;
pub mod model;
pub mod parallel;
pub mod plan;
pub mod plot;
pub mod prune;
pub mod rng;
pub mod sample;
pub mod store;
#[cfg(test)]
mod testdir;
pub mod train;
